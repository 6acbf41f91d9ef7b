"""`wanmesh bench cache`: step caching against no cache, per layout; runs in the CLI process and its worker pools.

For each layout (world 1, tp 2 and Ulysses 2 at world 2 by default) one pool samples the same request uncached
and with each ``--cache`` setting: wall time (median and spread over repeats, the repeats interleaved across the
settings) and the CPU time of the ranks' processes (the work done, which other load stretches far less than the
wall time), transformer calls and steps skipped, the savings against the uncached run beside the share of calls
skipped, and the latents' distance to the uncached run of the same layout (relative L2, max abs). The cached
latents of every layout are compared with world 1's too (the same settings must give the same latents). Prints a
table (with the load average before and after), writes JSON and a plot. Prompts are random embeddings of the
model's text width (no text encoder); the tiny and medium presets have random weights, so the steps a threshold
skips there are reported, not targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..config import ParallelConfig, latent_shape
from ..cache_settings import cache_fields, parse_cache
from .common import check_repeats, cpu_seconds, measured_runs, model_config, model_path

DEFAULT_CACHES = ("teacache:0.3:start=0.1", "teacache:0.6:start=0.1", "magcache:0.06:start=0.1",
                  "magcache:0.2:start=0.1:k=3", "fbcache:0.6:start=0.1", "fbcache:1.0:start=0.1")
LAYOUTS = {"world1": dict(world=1), "tp2": dict(world=2, tp=2), "ulysses2": dict(world=2, ulysses=2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="transformer file (default: the tiny T2V model; the medium preset's from "
                                        "`wanmesh make-tiny DIR --preset medium` is the reference size)")
    parser.add_argument("--models", type=Path, help="a tree written by `wanmesh make-tiny` (its T2V model)")
    parser.add_argument("--cache", action="append", help="a setting as for generate --cache, repeatable "
                        f"(default: {' '.join(DEFAULT_CACHES)})")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: the pool's default)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--sampler", default="unipc")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("wanmesh_bench_cache.json"))
    parser.add_argument("--plot", type=Path, default=Path("wanmesh_bench_cache.png"))


def _request(args, text_dim: int, cache):
    from ..protocol import SampleRequest

    generator = torch.Generator().manual_seed(0)
    positive, negative = torch.randn(24, text_dim, generator=generator), torch.randn(8, text_dim, generator=generator)
    return SampleRequest("", torch.zeros(latent_shape(args.width, args.height, args.frames)), [positive], [negative],
                         seed=1, steps=args.steps, guidance_scale=5.0, shift=5.0, sampler=args.sampler,
                         cache=cache_fields(cache))


def _layout_rows(args, layout: str, path: str, text_dim: int, caches: list, run) -> list[dict]:
    """One pool's rows: the repeats interleaved (repeat 1 of every setting, then repeat 2, ...) so that a change
    of the machine's load lands on every setting alike."""
    from dataclasses import replace

    from ..driver.pool import WorkerPool
    from ..protocol import LoadModel

    devices = "cpu" if args.device == "cpu" else "auto"
    config = ParallelConfig(devices=devices, **LAYOUTS[layout])
    settings = [("none", None), *((c, parse_cache(c)) for c in caches)]
    seconds: dict[str, list[float]] = {text: [] for text, _ in settings}
    cpu: dict[str, list[float]] = {text: [] for text, _ in settings}
    replies: dict = {}
    with WorkerPool(config, timeout_s=3600) as pool:
        handle = pool.call(LoadModel(path)).handle
        pool.call(replace(_request(args, text_dim, None), handle=handle, steps=2))  # warm-up, not timed
        for repeat in range(args.repeats):
            for text, cache in settings:
                run(f"{layout}, cache {text}, repeat {repeat + 1}/{args.repeats}")
                cpu_start, start = cpu_seconds(pool.pids()), time.perf_counter()
                replies[text] = pool.call(replace(_request(args, text_dim, cache), handle=handle))
                seconds[text].append(time.perf_counter() - start)
                cpu[text].append(cpu_seconds(pool.pids()) - cpu_start)
    return [_row(args, layout, text, seconds[text], cpu[text], replies[text]) for text, _ in settings]


def _row(args, layout: str, text: str, seconds: list[float], cpu: list[float], reply) -> dict:
    report = reply.cache_report or {"computed": args.steps, "skipped": 0, "skipped_steps": [],
                                    "calls": 2 * args.steps}
    row = {"layout": layout, "cache": text, "seconds": statistics.median(seconds), "runs_s": seconds,
           "spread_s": max(seconds) - min(seconds), "cpu_s": statistics.median(cpu), "runs_cpu_s": cpu,
           "calls": report["calls"], "skipped": report["skipped"], "skipped_steps": report["skipped_steps"],
           "latents": reply.latents}
    print(f"  {layout} {text}: median {row['seconds']:.2f} s (spread {row['spread_s']:.2f} s), CPU "
          f"{row['cpu_s']:.2f} s, {report['calls']} calls, {report['skipped']} steps skipped", flush=True)
    return row


def _distances(rows: list[dict]) -> None:
    """Each row's latents against its layout's uncached run, and against world 1's run with the same cache."""
    reference = {(r["layout"], r["cache"]): r["latents"] for r in rows}
    for row in rows:
        plain = reference[(row["layout"], "none")]
        difference = row["latents"] - plain
        row["rel_l2"] = float(difference.norm() / plain.norm())
        row["max_abs"] = float(difference.abs().max())
        uncached = next(r for r in rows if r["layout"] == row["layout"] and r["cache"] == "none")
        row["saving"] = 1.0 - row["seconds"] / uncached["seconds"]
        row["spread_share"] = row["spread_s"] / uncached["seconds"]  # the spread as a share of the uncached time
        row["cpu_saving"] = 1.0 - row["cpu_s"] / uncached["cpu_s"] if uncached["cpu_s"] > 0 else 0.0
        row["calls_skipped"] = 1.0 - row["calls"] / uncached["calls"]
        world1 = reference.get(("world1", row["cache"]))
        row["vs_world1_max_abs"] = None if world1 is None else float((row["latents"] - world1).abs().max())


def _load(values) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _world1(row: dict) -> str:
    return "-" if row["vs_world1_max_abs"] is None else f"{row['vs_world1_max_abs']:.1e}"


TABLE = (("layout", "<9", "layout"), ("cache", "<28", "cache"), ("wall s", ">8.2f", "seconds"),
         ("spread", ">7.2f", "spread_s"), ("CPU s", ">8.2f", "cpu_s"), ("calls", ">6", "calls"),
         ("skipped", ">8", "skipped"), ("calls cut", ">9.0%", "calls_skipped"), ("saving", ">7.0%", "saving"),
         ("CPU sav", ">7.0%", "cpu_saving"), ("rel L2", ">8.4f", "rel_l2"), ("max abs", ">8.4f", "max_abs"),
         ("vs world1", ">9", _world1))  # (header, format, row key or function)


def format_table(rows: list[dict]) -> str:
    header = " ".join(f"{name:{spec.split('.')[0]}}" for name, spec, _ in TABLE)
    lines = [" ".join(f"{key(r) if callable(key) else r[key]:{spec}}" for _, spec, key in TABLE) for r in rows]
    return "\n".join([header, *lines])


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (saving_axes, error_axes) = plt.subplots(1, 2, figsize=(12, 5))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        points = [r for r in rows if r["layout"] == layout and r["cache"] != "none"]
        saving_axes.scatter([r["calls_skipped"] for r in points], [r["saving"] for r in points], label=layout)
        saving_axes.scatter([r["calls_skipped"] for r in points], [r["cpu_saving"] for r in points], marker="x",
                            label=f"{layout} (CPU time)")
        error_axes.scatter([r["calls_skipped"] for r in points], [r["rel_l2"] for r in points], label=layout)
    saving_axes.plot([0, 1], [0, 1], linestyle="--", linewidth=1, label="saving = calls skipped")
    saving_axes.set(xlabel="share of transformer calls skipped", ylabel="saving (wall, CPU time)", title="time saved")
    error_axes.set(xlabel="share of transformer calls skipped", ylabel="relative L2 to the uncached latents",
                   title="distance to the uncached run")
    for axes in (saving_axes, error_axes):
        axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args) -> list[dict]:
    check_repeats(args.repeats)
    caches = args.cache or list(DEFAULT_CACHES)
    for text in caches:
        parse_cache(text)  # bad settings fail before any pool starts
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"--layouts: {', '.join(unknown)} unknown; valid: {', '.join(LAYOUTS)}")
    path = model_path(args)
    text_dim = model_config(path)["text_dim"]
    if args.threads:
        os.environ["WANMESH_WORKER_THREADS"] = str(args.threads)
    run = measured_runs(len(layouts) * (len(caches) + 1) * args.repeats)
    load_before = os.getloadavg()
    rows = [row for layout in layouts for row in _layout_rows(args, layout, path, text_dim, caches, run)]
    _distances(rows)
    title = (f"{Path(path).name}, {args.width}x{args.height}, {args.frames} frames, {args.steps} steps "
             f"{args.sampler}, {args.device}")
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"wanmesh bench cache: {title}; {args.repeats} interleaved repeats, load average (1, 5, 15 min) "
          f"before {_load(load['before'])}, after {_load(load['after'])}")
    print(format_table(rows))
    for row in rows:
        row.pop("latents")
    args.json.write_text(json.dumps({"title": title, "repeats": args.repeats, "load_average": load, "rows": rows}, indent=2))
    write_plot(rows, args.plot, title)
    print(f"JSON written to {args.json}, plot to {args.plot}")
    return rows
