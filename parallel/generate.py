"""`wanmesh generate`: text to video through the engine, writing an MP4 and optionally latents and frames."""

from __future__ import annotations

import sys
import time

import torch
from safetensors.torch import save_file

from .engine import Engine
from .sampling import SampleRequest
from .video import latent_shape, write_mp4


def _device(name: str | None) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but this machine has no CUDA device; use --device cpu")
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _progress(step: int, total: int) -> None:
    print(f"\r  step {step}/{total}", end="\n" if step == total else "", file=sys.stderr, flush=True)


def generate(args, files: dict[str, str | None]) -> None:
    shape = latent_shape(args.width, args.height, args.frames)  # rejects bad sizes before loading anything
    engine = Engine(_device(args.device))
    started = time.perf_counter()
    text = engine.load_text_encoder(files["text_encoder"], dtype=args.dtype)
    positive, negative = engine.encode_text(text, [args.prompt]), engine.encode_text(text, [args.negative])
    engine.unload(text)
    model = engine.load_model(files["model"], vace_module=files["vace_module"], dtype=args.dtype)
    request = SampleRequest(
        latent=torch.zeros(shape), positive=positive, negative=negative, seed=args.seed, steps=args.steps,
        cfg=args.cfg, shift=args.shift, sampler=args.sampler,
    )
    latents = engine.sample(model, request, progress=_progress)
    engine.unload(model)
    frames = engine.decode(engine.load_vae(files["vae"], dtype=args.dtype), latents)
    write_mp4(frames, args.out, fps=args.fps)
    if args.save_latents:
        save_file({"latents": latents.float().contiguous()}, str(args.save_latents))
    if args.save_frames:
        save_file({"frames": frames.float().contiguous()}, str(args.save_frames))
    seconds = time.perf_counter() - started
    print(f"wrote {args.out} ({frames.shape[0]} frames, {args.width}x{args.height}) in {seconds:.1f} s")
