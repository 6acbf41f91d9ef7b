"""`wanmesh bench vae`: tiled Wan VAE decode (and encode) time and peak memory per rank at several vae_patch sizes,
for the Wan 2.1 or the Wan 2.2 VAE; runs in the CLI process and the ranks it spawns.

Default workload: a 17-frame 256x256 video decoded with 128 px tiles and a 32 px overlap. ``--vae 2.1`` (default) is a
Wan 2.1-sized VAE (``base_dim`` 96, 16 latent channels, 8x spatial: latents ``[1, 16, 5, 32, 32]``, a 3x3 grid of
tiles); ``--vae 2.2`` is the Wan 2.2 VAE's structure at ComfyUI's widths (encoder 160, decoder 256, 48 latent
channels, 2x2 patches, 16x spatial: latents ``[1, 48, 5, 16, 16]``). The weights are random (speed and memory do
not depend on them). ``--stages decode,encode`` adds the tiled encode of a video of the same size.

Every (stage, vae_patch) pair runs in fresh processes, one thread per rank, so peak memory is that pair's own;
``--rounds`` repeats the whole sequence, alternating its order, so drifting machine load hits every size alike.
Each process makes ``--warmup`` untimed calls, then ``--repeats`` timed ones (the slowest rank's time); the table
gives the median and the fastest and slowest of all timed calls. Rank 0's output is compared with the first
vae_patch size's (``max_diff``): patch parallelism must not change the pixels. On CPU memory is the process's peak
resident set, also shown above the level reached before the timed calls; on CUDA it is the peak allocated by
PyTorch. ``--json OUT`` writes the rows and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import LATENT_CHANNELS, TEMPORAL_STRIDE, VAE_SPATIAL_FACTOR
from ..distributed.patch_parallel import assign_by_workload
from ..distributed.spawn import slowest_rank_seconds, spawn_ranks
from ..networks.vae_tiling import resolve_tile_options, split_spatial, tiled_decode, tiled_encode
from .common import int_list, measured_runs

VAE_KINDS = ("2.1", "2.2")
STAGES = ("decode", "encode")
DEFAULT_BASE_DIM = {"2.1": 96, "2.2": 160}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `wanmesh bench vae`."""
    parser.add_argument("--vae", choices=VAE_KINDS, default="2.1",
                        help="which VAE: 2.1 (16 channels, 8x) or 2.2 (48 channels, 16x, TI2V 5B's)")
    parser.add_argument("--stages", default="decode", help="comma-separated: decode, encode (default decode)")
    parser.add_argument("--frames", type=int, default=17, help="video frames (4n + 1); latents get (frames-1)/4 + 1")
    parser.add_argument("--height", type=int, default=256, help="video height in pixels (multiple of the VAE's factor)")
    parser.add_argument("--width", type=int, default=256, help="video width in pixels (multiple of the VAE's factor)")
    parser.add_argument("--tile-px", type=int, default=128, help="tile edge in pixels")
    parser.add_argument("--overlap-px", type=int, default=None, help="tile overlap in pixels (default: a quarter tile)")
    parser.add_argument("--patches", default="1,2", help="comma-separated vae_patch sizes; the first is the base")
    parser.add_argument("--base-dim", type=int, default=None,
                        help="encoder width (default: the real VAE's, 96 for 2.1 and 160 for 2.2; the 2.2 decoder "
                             "gets 8/5 of it, as 160/256)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda runs rank r on cuda:r (NCCL)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per process before timing")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per process")
    parser.add_argument("--rounds", type=int, default=1, help="times the whole sequence of sizes runs, interleaved")
    parser.add_argument("--json", type=Path, help="also write the rows and speed-ups here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the benchmark is abandoned")
    return parser


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`), print a table, return the rows."""
    settings = _settings(args)
    patches, stages = settings["patches"], settings["stages"]
    _check_devices(args.device, max(patches))
    samples: dict[tuple[str, int], list[dict]] = {(s, p): [] for s in stages for p in patches}
    outputs: dict[tuple[str, int], torch.Tensor] = {}
    run = measured_runs(settings["rounds"] * len(stages) * len(patches))  # a world each
    for round_index in range(settings["rounds"]):
        order = patches if round_index % 2 == 0 else patches[::-1]
        for stage in stages:
            for patch in order:
                run(f"{stage}, patch {patch}, round {round_index + 1}/{settings['rounds']}")
                rows, output = _run_world(dict(settings, stage=stage, patch=patch), args.timeout)
                samples[stage, patch].append(rows)
                outputs.setdefault((stage, patch), output)
    rows = [row for stage in stages for patch in patches
            for row in _summarise(stage, patch, samples[stage, patch], outputs, patches[0])]
    speedups = _speedups(rows, stages, patches)
    print(_format_table(rows, speedups, settings))
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": _public(settings), "rows": rows, "speedups": speedups}, indent=1))
    return rows


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every option checked and resolved, before any process starts."""
    base_dim = args.base_dim or DEFAULT_BASE_DIM[args.vae]
    config = _vae_config(args.vae, base_dim)
    factor = config["scale_factor_spatial"]
    tile_px, overlap_px = resolve_tile_options(args.tile_px, args.overlap_px, factor)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages):
        raise ValueError(f"--stages takes decode and/or encode (e.g. decode,encode), got {args.stages!r}")
    for flag, value, least in (("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                               ("--rounds", args.rounds, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    return {
        "vae": args.vae, "config": config, "factor": factor, "device": args.device, "stages": stages,
        "patches": int_list(args.patches, "--patches"), "tile_px": tile_px, "overlap_px": overlap_px,
        "frames": args.frames, "height": args.height, "width": args.width, "warmup": args.warmup,
        "repeats": args.repeats, "rounds": args.rounds, "timeout": args.timeout,
        "latent_shape": _latent_shape(args.frames, args.height, args.width, factor, config["z_dim"]),
    }


def _vae_config(kind: str, base_dim: int) -> dict[str, Any]:
    """``AutoencoderKLWan`` kwargs of the benchmarked VAE: Wan 2.1's defaults, or the Wan 2.2 structure."""
    if base_dim < 1:
        raise ValueError(f"--base-dim must be a positive width, got {base_dim}")
    if kind == "2.1":
        return {"base_dim": base_dim, "z_dim": LATENT_CHANNELS, "scale_factor_spatial": VAE_SPATIAL_FACTOR}
    from ..tiny.vae22 import NATIVE_VAE22_WIDTHS, TINY_VAE22

    decoder = base_dim * NATIVE_VAE22_WIDTHS["decoder_base_dim"] // NATIVE_VAE22_WIDTHS["base_dim"]
    return {**TINY_VAE22, "base_dim": base_dim, "decoder_base_dim": max(decoder, 1)}


def _latent_shape(frames: int, height: int, width: int, factor: int, channels: int) -> tuple[int, ...]:
    if frames < 1 or frames % TEMPORAL_STRIDE != 1:
        raise ValueError(f"--frames must be 4n + 1 (e.g. 17 or 21), got {frames}")
    if height < 1 or width < 1 or height % factor or width % factor:
        raise ValueError(f"--height and --width must be positive multiples of {factor} for this VAE, "
                         f"got {height}x{width}")
    return (1, channels, (frames - 1) // TEMPORAL_STRIDE + 1, height // factor, width // factor)


def _check_devices(device: str, ranks: int) -> None:
    if device == "cuda" and torch.cuda.device_count() < ranks:
        found = torch.cuda.device_count()
        raise ValueError(f"--device cuda needs {ranks} GPUs for the largest vae_patch, found {found}")


def _run_world(settings: dict[str, Any], timeout: float) -> tuple[list[dict], torch.Tensor]:
    """One (stage, vae_patch) world in fresh processes: every rank's row and rank 0's output."""
    with tempfile.TemporaryDirectory(prefix="wanmesh-bench-vae-") as out_dir:
        spawn_ranks(_bench_rank, settings["patch"], args=(settings, out_dir), device=settings["device"],
                    deadline_s=timeout, pg_timeout_s=timeout)
        rows = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
        return rows, torch.load(Path(out_dir, "output.pt"))


def _bench_rank(rank: int, world: int, settings: dict[str, Any], out_dir: str) -> None:
    from diffusers import AutoencoderKLWan

    torch.set_flush_denormal(True)  # random weights can drift into denormals, which would distort CPU timings
    device = torch.device(f"cuda:{rank}" if settings["device"] == "cuda" else "cpu")
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**settings["config"]).to(device).eval()
    call, inputs = _stage_call(vae, settings, device)
    for _ in range(settings["warmup"]):
        call(inputs)
    baseline = _current_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = [slowest_rank_seconds(lambda: call(inputs), device) for _ in range(settings["repeats"])]
    peak = _peak_memory(device)
    output = call(inputs)  # collective: every rank takes part, rank 0 holds the merged result
    if rank == 0:
        torch.save(output.float().cpu(), Path(out_dir, "output.pt"))
    row = {"seconds": seconds, "peak_mib": peak / 2**20, "peak_over_start_mib": (peak - baseline) / 2**20,
           "rank": rank, "tiles": _tiles_of_rank(settings, world, rank)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(row))


def _stage_call(vae, settings: dict[str, Any], device: torch.device):
    """(the timed call, its seeded input) of the settings' stage."""
    generator = torch.Generator().manual_seed(0)
    tiles = {"tile_px": settings["tile_px"], "overlap_px": settings["overlap_px"], "group": None}
    if settings["stage"] == "decode":
        latents = torch.randn(settings["latent_shape"], generator=generator).to(device)
        return (lambda z: tiled_decode(vae, z, **tiles)), latents
    shape = (1, 3, settings["frames"], settings["height"], settings["width"])
    pixels = (torch.rand(shape, generator=generator) * 2 - 1).to(device)
    return (lambda x: tiled_encode(vae, x, **tiles)), pixels


def _current_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as statm:  # resident pages; psutil is not a dependency
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _tiles_of_rank(settings: dict[str, Any], world: int, rank: int) -> int:
    """How many tiles this rank runs: the stage's own grid (latent tiles for decode, pixel tiles for encode)."""
    factor = settings["factor"]
    if settings["stage"] == "decode":
        shape, tile, overlap, scale = settings["latent_shape"], settings["tile_px"] // factor, \
            settings["overlap_px"] // factor, factor
    else:
        shape = (1, 3, settings["frames"], settings["height"], settings["width"])
        tile, overlap, scale = settings["tile_px"], settings["overlap_px"], 1 / factor
    tasks, _ = split_spatial(torch.empty(shape, device="meta"), tile, overlap, out_scale=scale)
    return len(assign_by_workload(tasks, world)[rank])


def _summarise(stage: str, patch: int, worlds: list[list[dict]], outputs: dict, base_patch: int) -> list[dict]:
    """One row per rank of a (stage, vae_patch) pair over all its rounds: every call's time is the slowest rank's,
    memory the largest of the rounds."""
    seconds = [s for rows in worlds for s in rows[0]["seconds"]]
    diff = (outputs[stage, patch] - outputs[stage, base_patch]).abs().max().item()
    summary = []
    for rank_rows in zip(*worlds):
        summary.append({
            "stage": stage, "vae_patch": patch, "rank": rank_rows[0]["rank"], "tiles": rank_rows[0]["tiles"],
            "median_s": statistics.median(seconds), "spread_s": [min(seconds), max(seconds)], "samples_s": seconds,
            "peak_mib": max(r["peak_mib"] for r in rank_rows),
            "peak_over_start_mib": max(r["peak_over_start_mib"] for r in rank_rows), "max_diff": diff,
        })
    return summary


def _speedups(rows: list[dict], stages: list[str], patches: list[int]) -> list[dict]:
    """Per stage and vae_patch size: median time of the base size over this size's, and peak memory over start
    per rank (largest rank) against the base's."""
    def of(stage, patch):
        return [r for r in rows if r["stage"] == stage and r["vae_patch"] == patch]

    result = []
    for stage in stages:
        base = of(stage, patches[0])
        base_memory = max(max(r["peak_over_start_mib"] for r in base), 1e-9)
        for patch in patches[1:]:
            other = of(stage, patch)
            result.append({"stage": stage, "vae_patch": patch, "base": patches[0],
                           "speedup": base[0]["median_s"] / other[0]["median_s"],
                           "memory_ratio": max(r["peak_over_start_mib"] for r in other) / base_memory})
    return result


def _public(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in ("stage", "patch")}


def _format_table(rows: list[dict], speedups: list[dict], settings: dict[str, Any]) -> str:
    tile, overlap = settings["tile_px"], settings["overlap_px"]
    lines = [
        f"Wan {settings['vae']} VAE tiled {'/'.join(settings['stages'])}: {settings['frames']} frames "
        f"{settings['height']}x{settings['width']} px = latents {list(settings['latent_shape'])}, tile {tile} px, "
        f"overlap {overlap} px, width {settings['config']['base_dim']}, {settings['device']}, 1 thread per rank, "
        f"{settings['rounds']} round(s) x {settings['repeats']} timed call(s)",
        f"{'stage':>6} {'vae_patch':>9} {'rank':>4} {'tiles':>5} {'median_s':>8} {'spread_s':>15} {'peak_MiB':>9} "
        f"{'peak_over_start_MiB':>20} {'max_diff':>9}",
    ]
    for r in rows:
        low, high = r["spread_s"]
        lines.append(
            f"{r['stage']:>6} {r['vae_patch']:>9} {r['rank']:>4} {r['tiles']:>5} {r['median_s']:>8.3f} "
            f"{f'{low:.3f}-{high:.3f}':>15} {r['peak_mib']:>9.1f} {r['peak_over_start_mib']:>20.1f} "
            f"{r['max_diff']:>9.1e}"
        )
    for s in speedups:
        lines.append(f"{s['stage']} vae_patch {s['vae_patch']} vs {s['base']}: speedup x{s['speedup']:.2f} (medians, "
                     f"slowest rank), peak memory over start per rank x{s['memory_ratio']:.2f} (largest rank)")
    return "\n".join(lines)
