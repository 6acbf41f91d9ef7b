"""`wanmesh bench long-stream`: a causal stream of many times the trained length with a rolling KV window: the
memory one rank holds after every chunk (KV cache bytes, exact; the process's resident size, or the GPU's
allocated bytes), and whether anything steps at the window's edge; runs in the CLI process (one rank).

Three streams of the same noise and prompt on a random-weight transformer of the ``make-tiny`` presets (tiny in
fp32, medium in bf16): the whole video cached (the contrast: its cache grows with the stream), the rolling window
with the sink kept at the start (``--kv-window``, ``--sink``) and the same window re-anchored (``--reanchor``'s
sink right before the window's oldest frame). Memory: the median over the first window's chunks against the
median over the last quarter's, and the growth per 100 chunks fitted over the second half. The edge: the mean
absolute difference between neighbouring latent frames, within the first window (before anything is dropped),
across the first chunk boundary after the window rolls, across every later chunk boundary and within every later
chunk, and over the last quarter of the stream; a step in quality at the edge shows as a boundary difference
larger than the within-chunk one. The weights are random, so these are signs of drift and steps, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from ..config import check_stream_options, latent_shape, stream_chunks
from .common import mib

VARIANTS = (("whole video cached", False, False), ("rolling window", True, False), ("re-anchored window", True, True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["tiny", "medium"], default="tiny",
                        help="transformer size: the make-tiny presets (tiny fp32, medium bf16), random weights")
    parser.add_argument("--trained", type=int, default=21, help="the trained length in latent frames (Wan: 21)")
    parser.add_argument("--times", type=int, default=10, help="stream this many times the trained length")
    parser.add_argument("--width", type=int, default=32, help="video width (multiple of 16)")
    parser.add_argument("--height", type=int, default=32, help="video height (multiple of 16)")
    parser.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per chunk")
    parser.add_argument("--kv-window", type=int, default=None, help="latent frames attended (default: --trained)")
    parser.add_argument("--sink", type=int, default=3, help="pinned first latent frames")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")


def _model(preset: str, device: str):
    from diffusers import WanTransformer3DModel

    from ..tiny.models import MEDIUM_TRANSFORMER, TINY_TRANSFORMER, randomise_

    config, dtype = {"tiny": (TINY_TRANSFORMER, torch.float32), "medium": (MEDIUM_TRANSFORMER, torch.bfloat16)}[preset]
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config)
    randomise_(model, 11)
    model = model.to(device=device)
    return (model.to(dtype=dtype) if dtype != torch.float32 else model).eval().requires_grad_(False)


def _held_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.memory_allocated()
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def _stream(model, args, shape, window: bool, reanchor: bool) -> dict:
    from ..sampling.stream import sample_stream, stream_sigmas

    held: list[int] = []
    stats: dict = {}
    text = torch.randn(1, 32, model.config.text_dim, generator=torch.Generator().manual_seed(1))
    latents = sample_stream(
        model, positive=text.to(device=args.device, dtype=next(model.parameters()).dtype), negative=None,
        latent_shape=shape, seed=0, sigmas=stream_sigmas(args.steps, 5.0), chunk=args.chunk,
        kv_window=args.kv_window if window else None, sink=args.sink if window else 0, reanchor=reanchor,
        stats=stats, on_chunk=lambda index, start, chunk: held.append(_held_bytes(args.device)))
    return {"latents": latents, "held": held, "cache": stats["chunk_cache_bytes"]}


def memory_summary(per_chunk: list[int], first_window_chunks: int) -> dict:
    """Median over the first window's chunks and over the last quarter, and the least-squares growth per 100
    chunks over the second half (bytes)."""
    quarter = max(1, len(per_chunk) // 4)
    half = per_chunk[len(per_chunk) // 2:]
    xs = range(len(half))
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(half)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, half)) / spread if spread else 0.0
    return {"first_window": statistics.median(per_chunk[:max(1, first_window_chunks)]),
            "last_quarter": statistics.median(per_chunk[-quarter:]), "growth_per_100_chunks": 100 * slope}


def edge_summary(latents: torch.Tensor, chunks: list[tuple[int, int]], kv_window: int) -> dict:
    """Mean |x[f+1] - x[f]| over neighbouring latent frames, grouped as the module docstring says."""
    steps = (latents[:, :, 1:] - latents[:, :, :-1]).abs().float().mean(dim=(0, 1, 3, 4))  # [frames - 1]
    first_roll = next((i for i, (start, count) in enumerate(chunks) if start + count > kv_window), len(chunks))
    boundaries = [start - 1 for start, _ in chunks[first_roll + 1:]]  # pair (start-1, start) of each later chunk
    within_later = [f for start, count in chunks[first_roll:] for f in range(start, start + count - 1)]
    quarter = steps[-max(1, steps.shape[0] // 4):]
    pick = lambda frames: float(steps[frames].mean()) if frames else float("nan")  # noqa: E731
    return {"within_first_window": pick(list(range(0, min(kv_window, steps.shape[0] + 1) - 1))),
            "first_roll_boundary": pick([chunks[first_roll][0] - 1]) if first_roll < len(chunks) else float("nan"),
            "later_boundaries": pick(boundaries), "within_later_chunks": pick(within_later),
            "last_quarter": float(quarter.mean())}


def run(args: argparse.Namespace) -> dict:
    args.kv_window = args.kv_window or args.trained
    frames = args.trained * args.times
    if args.trained < 1 or args.times < 1:
        raise ValueError(f"--trained and --times must be at least 1, got {args.trained} and {args.times}")
    if args.width % 16 or args.height % 16 or min(args.width, args.height) < 16:
        raise ValueError(f"--width and --height must be multiples of 16, got {args.width}x{args.height}")
    check_stream_options(frames, args.chunk, args.kv_window, args.sink, True)
    shape = latent_shape(args.width, args.height, 4 * (frames - 1) + 1)
    chunks = stream_chunks(shape[2], args.chunk)
    first_window_chunks = sum(1 for start, count in chunks if start + count <= args.kv_window)
    model = _model(args.preset, args.device)
    results = {}
    with torch.no_grad():
        for name, window, reanchor in VARIANTS:
            run = _stream(model, args, shape, window, reanchor)
            results[name] = {"cache": memory_summary(run["cache"], first_window_chunks),
                             "held": memory_summary(run["held"], first_window_chunks),
                             "edge": edge_summary(run["latents"], chunks, args.kv_window)}
    print(format_table(results, args, len(chunks)))
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                                         "chunks": len(chunks), "results": results}, indent=2, default=str))
    return results


def format_table(results: dict, args, chunks: int) -> str:
    held = "GPU allocated" if args.device == "cuda" else "process RSS"
    lines = [f"long stream: {args.preset} preset, {args.trained * args.times} latent frames ({args.times}x the "
             f"trained {args.trained}) in {chunks} chunks of {args.chunk}, kv_window {args.kv_window}, sink {args.sink}",
             "", f"{'':22s} {'KV cache MiB':>22s} {held + ' MiB':>26s}",
             f"{'':22s} {'first win':>10s} {'last 1/4':>10s} {'first win':>8s} {'last 1/4':>8s} {'+/100 ch':>8s}"]
    for name, result in results.items():
        cache, proc = result["cache"], result["held"]
        lines.append(f"{name:22s} {mib(cache['first_window']):>10s} {mib(cache['last_quarter']):>10s} "
                     f"{mib(proc['first_window'], 0):>8s} {mib(proc['last_quarter'], 0):>8s} "
                     f"{mib(proc['growth_per_100_chunks'], 1):>8s}")
    lines += ["", "mean |x[f+1] - x[f]| of neighbouring latent frames",
              f"{'':22s} {'1st window':>10s} {'1st roll':>10s} {'later bnd':>10s} {'within ch':>10s} {'last 1/4':>10s}"]
    for name, result in results.items():
        edge = result["edge"]
        lines.append(f"{name:22s} " + " ".join(f"{edge[key]:10.4f}" for key in (
            "within_first_window", "first_roll_boundary", "later_boundaries", "within_later_chunks", "last_quarter")))
    return "\n".join(lines)
