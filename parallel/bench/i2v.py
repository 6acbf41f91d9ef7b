"""`wanmesh bench i2v`: the step time of image-to-video against text-to-video at the same size, on one device;
runs in the CLI process.

Each model kind is one guided step (two transformer calls, as cfg > 1 runs) through the workers' own code
(``sampling/guidance.py`` with ``sampling/forward.py``'s image inputs): the T2V model, Wan 2.1 I2V (36 input
channels and 257 CLIP vision tokens through a second cross-attention), FLF2V (two images' tokens) and a Wan 2.2
I2V expert (36 channels, no image tokens). The calls are interleaved and repeated (``common.time_interleaved``);
the table gives each kind's median, spread and ratio to T2V. By default the tiny models' native twins, which share
their size; ``--t2v``/``--i2v``/... take real files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import CLIP_VISION_TOKENS
from .common import time_interleaved

KINDS = {"t2v": "model_native", "i2v": "i2v", "flf2v": "flf2v", "wan22_i2v": "i2v_high"}  # kind: TINY_FILES name
CLIP_TOKENS = {"i2v": CLIP_VISION_TOKENS, "flf2v": 2 * CLIP_VISION_TOKENS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, help="a tree written by `wanmesh make-tiny` (default: the cache's)")
    for kind in KINDS:
        parser.add_argument(f"--{kind.replace('_', '-')}", dest=kind, help=f"the {kind} transformer file "
                            "(default: the tiny model of that kind)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows here")


def _paths(args) -> dict[str, str]:
    from ..tiny.files import TINY_FILES, ensure_tiny_models, tiny_cache_dir

    root = None
    paths = {}
    for kind, tiny_name in KINDS.items():
        if getattr(args, kind) is None and root is None:
            root = ensure_tiny_models(args.models or tiny_cache_dir())
        paths[kind] = getattr(args, kind) or str(root / TINY_FILES[tiny_name])
    return paths


def _guided_step(model, latent_shape: tuple, kind: str, device: torch.device):
    """One cfg-guided model evaluation of ``kind`` at the latent's size, with random inputs of the right shapes."""
    from ..sampling.forward import image_inputs
    from ..sampling.guidance import guided_prediction

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(latent_shape, generator=generator).to(device)
    text = torch.randn(1, 512, model.config.text_dim, generator=generator).to(device)
    clip = torch.randn(1, CLIP_TOKENS[kind], 1280, generator=generator) if kind in CLIP_TOKENS else None
    extra = image_inputs(model, None, clip, range(1), latent_shape, torch.float32, device)
    t = torch.tensor([500.0], device=device)

    def step():
        with torch.no_grad():
            return guided_prediction(model, latents, t, text, text, 5.0, extra)

    return step


def run(args) -> list[dict]:
    from ..config import latent_shape
    from ..weights.loaders import load_transformer

    device = torch.device(args.device)
    shape = latent_shape(args.width, args.height, args.frames, 1)
    steps = {kind: _guided_step(load_transformer(path, device=device), shape, kind, device)
             for kind, path in _paths(args).items()}
    timings = time_interleaved(steps, device, args.repeats)
    base = timings["t2v"].median
    rows = [{"kind": kind, "step_s": round(t.median, 4), "spread_s": [round(v, 4) for v in t.as_list()],
             "ratio_to_t2v": round(t.median / base, 3)} for kind, t in timings.items()]
    print(f"one guided step at {args.width}x{args.height}, {args.frames} frames, {args.device}, "
          f"{args.repeats} interleaved repeats (median [fastest, slowest])")
    for row in rows:
        print(f"  {row['kind']:>10}: {row['step_s']:.4f} s {row['spread_s']}  x{row['ratio_to_t2v']:.3f} of T2V")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows
