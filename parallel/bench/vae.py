"""`wanmesh bench vae`: tiled Wan VAE decode time and peak memory per rank at several vae_patch sizes, in one run;
runs in the CLI process and the ranks it spawns.

Default workload: a 17-frame 256x256 video, i.e. raw latents ``[1, 16, 5, 32, 32]``, decoded with 128 px tiles and a
32 px overlap (a 3x3 grid of 9 tiles) by a Wan 2.1-sized VAE (``base_dim`` 96) with random weights (speed and memory do
not depend on the weights). Each vae_patch size runs in fresh processes, one thread per rank, so peak memory is that
size's own. On CPU memory is the process's peak resident set, also shown above the level reached before decoding; on
CUDA it is the peak allocated by PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.patch_parallel import assign_by_workload
from ..models.vae_tiling import resolve_tile_options, split_spatial, tiled_decode
from ..distributed.spawn import spawn_ranks

SPATIAL_FACTOR = 8
TEMPORAL_FACTOR = 4


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `wanmesh bench vae`."""
    parser.add_argument("--frames", type=int, default=17, help="video frames (4n + 1); latents get (frames-1)/4 + 1")
    parser.add_argument("--height", type=int, default=256, help="video height in pixels (multiple of 8)")
    parser.add_argument("--width", type=int, default=256, help="video width in pixels (multiple of 8)")
    parser.add_argument("--tile-px", type=int, default=128, help="tile edge in pixels")
    parser.add_argument("--overlap-px", type=int, default=None, help="tile overlap in pixels (default: a quarter tile)")
    parser.add_argument("--patches", default="1,2", help="comma-separated vae_patch sizes; the first is the base")
    parser.add_argument("--base-dim", type=int, default=96, help="VAE width (96 is the Wan 2.1 VAE)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda runs rank r on cuda:r (NCCL)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decodes before timing")
    parser.add_argument("--repeats", type=int, default=1, help="timed decodes; the fastest is reported")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the benchmark is abandoned")
    return parser


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`), print a table, return the rows."""
    patches = _parse_patches(args.patches)
    latent_shape = _latent_shape(args.frames, args.height, args.width)
    tile_px, overlap_px = resolve_tile_options(args.tile_px, args.overlap_px, SPATIAL_FACTOR)
    _check_devices(args.device, max(patches))

    rows = []
    for patch in patches:
        with tempfile.TemporaryDirectory(prefix="wanmesh-bench-vae-") as out_dir:
            settings = dict(vars(args), tile_px=tile_px, overlap_px=overlap_px, latent_shape=latent_shape, patch=patch)
            _spawn_ranks(patch, settings, Path(out_dir), args.timeout)
            rows += [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    print(_format_table(rows, args, latent_shape, tile_px, overlap_px, patches))
    return rows


def _parse_patches(text: str) -> list[int]:
    try:
        patches = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        patches = []
    if not patches or min(patches) < 1:
        raise ValueError(f"--patches must list positive vae_patch sizes such as '1,2', got {text!r}")
    return patches


def _latent_shape(frames: int, height: int, width: int) -> tuple[int, ...]:
    if frames < 1 or frames % TEMPORAL_FACTOR != 1:
        raise ValueError(f"--frames must be 4n + 1 (e.g. 17 or 21), got {frames}")
    if height < 1 or width < 1 or height % SPATIAL_FACTOR or width % SPATIAL_FACTOR:
        raise ValueError(f"--height and --width must be positive multiples of {SPATIAL_FACTOR}, got {height}x{width}")
    return (1, 16, (frames - 1) // TEMPORAL_FACTOR + 1, height // SPATIAL_FACTOR, width // SPATIAL_FACTOR)


def _check_devices(device: str, ranks: int) -> None:
    if device == "cuda" and torch.cuda.device_count() < ranks:
        found = torch.cuda.device_count()
        raise ValueError(f"--device cuda needs {ranks} GPUs for the largest vae_patch, found {found}")


def _spawn_ranks(world: int, settings: dict[str, Any], out_dir: Path, timeout: float) -> None:
    spawn_ranks(_bench_rank, world, args=(settings, str(out_dir)), device=settings["device"],
                deadline_s=timeout, pg_timeout_s=settings["timeout"])


def _bench_rank(rank: int, world: int, settings: dict[str, Any], out_dir: str) -> None:
    torch.set_flush_denormal(True)  # random weights can drift into denormals, which would distort CPU timings
    device = torch.device(f"cuda:{rank}" if settings["device"] == "cuda" else "cpu")
    vae = _random_wan_vae(settings["base_dim"], device)
    latents = torch.randn(settings["latent_shape"], generator=torch.Generator().manual_seed(0)).to(device)
    result = _time_decodes(vae, latents, settings, device)
    result.update(rank=rank, vae_patch=world, tiles=_tiles_of_rank(settings, world, rank))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _random_wan_vae(base_dim: int, device: torch.device) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=base_dim, z_dim=16).to(device).eval()


def _time_decodes(vae: torch.nn.Module, latents: torch.Tensor, settings: dict[str, Any], device: torch.device) -> dict:
    def decode() -> float:
        dist.barrier()
        start = time.perf_counter()
        tiled_decode(vae, latents, tile_px=settings["tile_px"], overlap_px=settings["overlap_px"], group=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(settings["warmup"]):
        decode()
    baseline = _current_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = min(decode() for _ in range(max(1, settings["repeats"])))
    peak = _peak_memory(device)
    return {"seconds": seconds, "peak_mib": peak / 2**20, "peak_over_start_mib": (peak - baseline) / 2**20}


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
    tile, overlap = settings["tile_px"] // SPATIAL_FACTOR, settings["overlap_px"] // SPATIAL_FACTOR
    placeholder = torch.empty(settings["latent_shape"], device="meta")
    tasks, _ = split_spatial(placeholder, tile, overlap, out_scale=SPATIAL_FACTOR)
    return len(assign_by_workload(tasks, world)[rank])


def _format_table(
    rows: list[dict],
    args: argparse.Namespace,
    latent_shape: tuple[int, ...],
    tile_px: int,
    overlap_px: int,
    patches: list[int],
) -> str:
    lines = [
        f"VAE tiled decode: {args.frames} frames {args.height}x{args.width} px = latents {list(latent_shape)}, "
        f"tile {tile_px} px, overlap {overlap_px} px, base_dim {args.base_dim}, {args.device}, 1 thread per rank",
        f"{'vae_patch':>9} {'rank':>4} {'tiles':>5} {'time_s':>8} {'peak_MiB':>9} {'peak_over_start_MiB':>20}",
    ]
    for r in rows:
        lines.append(
            f"{r['vae_patch']:>9} {r['rank']:>4} {r['tiles']:>5} {r['seconds']:>8.2f} "
            f"{r['peak_mib']:>9.1f} {r['peak_over_start_mib']:>20.1f}"
        )
    base = [r for r in rows if r["vae_patch"] == patches[0]]
    for patch in patches[1:]:
        other = [r for r in rows if r["vae_patch"] == patch]
        speedup = max(r["seconds"] for r in base) / max(r["seconds"] for r in other)
        base_memory = max(max(r["peak_over_start_mib"] for r in base), 1e-9)
        memory = max(r["peak_over_start_mib"] for r in other) / base_memory
        lines.append(
            f"vae_patch {patch} vs {patches[0]}: speedup x{speedup:.2f} (slowest rank), "
            f"peak memory over start per rank x{memory:.2f} (largest rank)"
        )
    return "\n".join(lines)
