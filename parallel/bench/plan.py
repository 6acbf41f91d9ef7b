"""`wanmesh bench plan`: the auto layout's predictions against measured step times; runs in the CLI process and the
pools' workers.

For one job (model, size, frames, steps) and world size, every valid layout (or, when there are many, the
predicted best few plus an even sample of the rest) gets its own pool; after a warm-up the layouts are timed in
interleaved rounds, each sampling ``--steps`` steps with the same latent, prompt and seed. When the pools of every
measured layout fit in memory at once they stay up for the whole run; else (``--pools in-turn``, the default for
larger models: on GPUs two pools of a real model never fit beside each other; and where CPU ranks outnumber the
cores, since idle pools then disturb the measured one) each round starts every layout's pool in turn, warms it up,
times it and stops it, so one pool at a time holds the weights. The table prints the predicted and measured
seconds per step (median, fastest..slowest), the Spearman rank correlation of the two, the layout ``auto`` chose
and how far its measured time is from the best measured one. ``--json`` writes ``layouts`` (``layout``,
``predicted_s``, ``measured_s``, spread, degrees, ``cross_host``: the groups that cross hosts, null on one host)
and ``chosen``; ``--plot`` draws predicted against measured. The auto layout's table of every candidate is printed
first. ``--backend ray --ray-address HOST:PORT`` runs every
pool (the calibration's too) as actors on that Ray cluster, placed by host as the Ray backend places them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from ..auto_layout import CROSS_HOST_COLUMN, Job, ModelCost, Prediction, choose, explain
from ..calibration import machine_for
from ..config import ParallelConfig, latent_shape
from ..driver.pool import WorkerPool
from ..fields import BY_KEY
from ..driver.runner import PoolRunner
from ..protocol import SampleRequest
from . import hardware
from .common import Timing, check_repeats, measured_runs, model_config, model_path, time_interleaved, wall_seconds
from .releases import RELEASES

DEFAULT_WORLD = 2
PREDICTED_BEST = 4  # with more layouts than --max-layouts: these, then an even sample of the rest
POOL_MODES = ("auto", "together", "in-turn")
WORKER_PROCESS_BYTES = 512 * 2**20  # a worker's own memory before any weights (Python, torch, diffusers; CUDA context)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="transformer file (default: the tiny T2V model); with --hardware also a "
                                        "released model's name: " + ", ".join(RELEASES))
    parser.add_argument("--models", type=Path, help="a tiny models tree (default: the cache's)")
    parser.add_argument("--world", type=int, help=f"ranks (default {DEFAULT_WORLD}; not with --hardware)")
    parser.add_argument("--devices", default="auto", help="auto, cpu, cuda or a list such as cuda:0,cuda:1")
    parser.add_argument("--backend", choices=BY_KEY["backend"].choices, default=BY_KEY["backend"].default,
                        help=BY_KEY["backend"].help)
    parser.add_argument("--ray-address", default="", help=BY_KEY["ray_address"].help)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample (default 2)")
    parser.add_argument("--cfg", type=float, default=5.0, help="guidance scale; 1 runs no unconditional pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    parser.add_argument("--max-layouts", type=int, default=8, help="layouts measured at most (default 8)")
    parser.add_argument("--pools", choices=POOL_MODES, default="auto",
                        help="together: every layout's pool up for the whole run; in-turn: one pool at a time, "
                             "started and stopped each round; auto (default): together when they fit in memory and "
                             "the CPU ranks do not outnumber the cores")
    parser.add_argument("--reprobe", action="store_true", help="calibrate the machine again, not from the cache")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="PNG of predicted against measured step time")
    hardware.add_arguments(parser)


def measured_subset(ranked: list[Prediction], limit: int) -> list[Prediction]:
    """All layouts when they are few; else the predicted best ones and an even sample of the rest."""
    if len(ranked) <= limit:
        return ranked
    best, rest = ranked[:min(PREDICTED_BEST, limit)], ranked[min(PREDICTED_BEST, limit):]
    take = limit - len(best)
    picked = sorted({round(i * (len(rest) - 1) / max(take - 1, 1)) for i in range(take)})
    return best + [rest[index] for index in picked]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for position in range(start, end + 1):
                result[order[position]] = (start + end) / 2
            start = end + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mean_x, mean_y = sum(rx) / len(rx), sum(ry) / len(ry)
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(rx, ry))
    spread = (sum((a - mean_x) ** 2 for a in rx) * sum((b - mean_y) ** 2 for b in ry)) ** 0.5
    return covariance / spread if spread else 1.0


def run(args: argparse.Namespace) -> dict:
    """Every layout measured here against its prediction; with ``--hardware``, predicted on that GPU cluster only
    (``hardware.run``)."""
    if hardware.wanted(args):
        return hardware.run(args)
    if args.world is None:
        args.world = DEFAULT_WORLD
    path = model_path(args)
    job = Job(args.width, args.height, args.frames, steps=args.steps, guidance=args.cfg != 1.0)
    base = ParallelConfig(world=args.world, devices=args.devices, backend=args.backend,
                          ray_address=args.ray_address or None)
    machine = machine_for(base, reprobe=args.reprobe)
    ranked = choose(args.world, ModelCost.from_file(path), job, machine)
    print(explain(ranked, job, shown=len(ranked)), flush=True)  # the model's whole ranking, measured or not
    chosen = ranked[0]
    subset = measured_subset(ranked, args.max_layouts)
    text_dim = model_config(path)["text_dim"]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randn(512, text_dim, generator=generator) for _ in range(2)]
    latent = torch.zeros(latent_shape(args.width, args.height, args.frames))

    def sampler_on_new_pool(stack: contextlib.ExitStack, prediction: Prediction):
        runner = PoolRunner(stack.enter_context(WorkerPool(prediction.layout.applied_to(base))))
        request = SampleRequest(handle=runner.load_model(path), latent=latent, positive=[prompts[0]],
                                negative=[prompts[1]], seed=1, steps=args.steps, guidance_scale=args.cfg,
                                shift=5.0, sampler="euler", preview=False)
        return lambda: runner.sample(request)

    in_turn = args.pools == "in-turn" or (args.pools == "auto" and not together_by_default(subset, machine, base))
    print(f"measuring {len(subset)} layouts, " + ("one pool at a time, started each round" if in_turn else
                                                  "every pool up at once"), flush=True)
    if in_turn:
        timings = time_in_turn(subset, sampler_on_new_pool, args.repeats)
    else:
        with contextlib.ExitStack() as stack:
            samplers = {p.layout.name(): sampler_on_new_pool(stack, p) for p in subset}
            timings = time_interleaved(samplers, torch.device("cpu"), args.repeats)
    return report(args, subset, chosen, timings, machine)


def together_by_default(subset: list[Prediction], machine, config: ParallelConfig) -> bool:
    """``--pools auto``: together when the pools fit beside each other and each rank has cores of its own. Where
    CPU ranks outnumber the cores, idle pools slow the measured one down, and unevenly across layouts: the tiny
    model at 512x320 on four ranks and two cores measured 0.76 s a step for cfg_parallel with the other seven pools
    up, 0.52 s with its pool alone (an idle pool's workers use under 1% of a core each)."""
    return pools_fit_together(subset, machine) and not machine.ranks_share_cores(config.world)


def pools_fit_together(subset: list[Prediction], machine) -> bool:
    """Whether every measured layout's pool fits beside the others: their predicted bytes per rank, each worker
    process's own memory included, within a rank's free memory (the ranks of all pools share the devices)."""
    return sum(p.memory_bytes + WORKER_PROCESS_BYTES for p in subset) <= machine.free_bytes


def time_in_turn(subset: list[Prediction], sampler_on_new_pool, repeats: int) -> dict[str, Timing]:
    """Seconds per sample of each layout, one pool at a time: each round starts every layout's pool in turn,
    loads the model, samples once to warm up, times one sample and stops the pool (interleaved like
    ``time_interleaved``: drifting load hits every layout alike)."""
    check_repeats(repeats)
    samples: dict[str, list[float]] = {p.layout.name(): [] for p in subset}
    run = measured_runs(repeats * len(subset))
    for round_index in range(repeats):
        for prediction in subset:
            run(f"{prediction.layout.name()}, round {round_index + 1}/{repeats}")
            with contextlib.ExitStack() as stack:
                sample = sampler_on_new_pool(stack, prediction)
                sample()
                samples[prediction.layout.name()].append(wall_seconds(sample, torch.device("cpu")))
    return {name: Timing.of(s) for name, s in samples.items()}


def report(args, subset: list[Prediction], chosen: Prediction, timings: dict, machine) -> dict:
    rows = [{"layout": p.layout.name(), "predicted_s": p.step_s, "measured_s": timings[p.layout.name()].median / args.steps,
             "min_s": timings[p.layout.name()].low / args.steps, "max_s": timings[p.layout.name()].high / args.steps,
             "tp": p.layout.tp, "ulysses": p.layout.ulysses, "ring": p.layout.ring,
             "cfg_parallel": p.layout.cfg_parallel, "vae_patch": p.layout.vae_patch,
             "cross_host": list(p.cross_host) if p.cross_host is not None else None} for p in subset]
    best = min(rows, key=lambda row: row["measured_s"])
    chosen_row = next(row for row in rows if row["layout"] == chosen.layout.name())
    result = {"layouts": rows, "chosen": chosen.layout.name(), "best_measured": best["layout"],
              "chosen_over_best": chosen_row["measured_s"] / best["measured_s"],
              "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
              "job": {"width": args.width, "height": args.height, "frames": args.frames, "steps": args.steps,
                      "cfg": args.cfg, "world": args.world}, "machine": dataclasses.asdict(machine)}
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        write_plot(result, args.plot)
    return result


def print_table(result: dict) -> None:
    job = result["job"]
    print(f"world {job['world']}, {job['width']}x{job['height']}, {job['frames']} frames, {job['steps']} steps per "
          f"sample, cfg {job['cfg']}")
    several = any(row.get("cross_host") is not None for row in result["layouts"])
    print(f"  {'layout':<40} {'predicted s/step':>17} {'measured s/step':>16} {'min..max':>16}"
          + (f"  {CROSS_HOST_COLUMN}" if several else ""))
    for row in sorted(result["layouts"], key=lambda r: r["measured_s"]):
        mark = "*" if row["layout"] == result["chosen"] else " "
        crossing = f"  {', '.join(row['cross_host'] or ()) or 'none'}" if several else ""
        print(f"{mark} {row['layout']:<40} {row['predicted_s']:>17.4f} {row['measured_s']:>16.4f} "
              f"{row['min_s']:>7.4f}..{row['max_s']:<8.4f}{crossing}")
    print(f"auto chose: {result['chosen']} (*), measured {result['chosen_over_best']:.3f}x the best "
          f"({result['best_measured']}); Spearman rank correlation predicted/measured {result['spearman']:.2f}")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 5))
    for row in result["layouts"]:
        chosen = row["layout"] == result["chosen"]
        axes.scatter(row["predicted_s"], row["measured_s"], color="tab:red" if chosen else "tab:blue")
        axes.annotate(row["layout"], (row["predicted_s"], row["measured_s"]), fontsize=7)
    axes.set_xlabel("predicted s/step")
    axes.set_ylabel("measured s/step (median)")
    axes.set_title(f"auto layout, world {result['job']['world']}: Spearman {result['spearman']:.2f}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
