"""`wanmesh generate`: text to video (and VACE video editing) through the worker pool, writing an MP4 and
optionally latents, frames and the VACE context.

Runs in the CLI (driver) process; all model work happens in the pool's workers.
"""

from __future__ import annotations

import sys
import time

import torch
from safetensors.torch import save_file

from ..config import ParallelConfig, check_tiles, latent_shape
from ..driver.pool import WorkerPool
from ..driver.runner import PoolRunner
from ..protocol import SampleRequest
from .vace_inputs import VaceInputs, VaceSources
from .video_file import write_mp4


def pool_config(args) -> ParallelConfig:
    """The worker pool the command line asked for (checked before any process starts)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but this machine has no CUDA device; use --device cpu")
    return ParallelConfig(
        world=args.world, tp=args.tp, ulysses=args.ulysses, ring=args.ring, cfg_parallel=args.cfg_parallel,
        vae_patch=args.vae_patch, devices=args.device or "auto",
        worker_timeout=getattr(args, "worker_timeout", 60.0),
    )


def _progress(step: int, total: int) -> None:
    print(f"\r  step {step}/{total}", end="\n" if step == total else "", file=sys.stderr, flush=True)


def generate(args, files: dict[str, str | None], vace: VaceSources | None = None) -> None:
    """Sample, decode and write; every input (VACE ones included) is checked before the pool starts."""
    inputs = vace.build(args.width, args.height, args.frames) if vace is not None else None
    shape = latent_shape(args.width, args.height, args.frames)  # rejects bad sizes before loading anything
    config = pool_config(args)
    check_tiles(args.vae_tile, args.vae_overlap)
    started = time.perf_counter()
    with WorkerPool(config) as pool:
        frames, latents = _run(PoolRunner(pool), args, files, shape, inputs)
    write_mp4(frames, args.out, fps=args.fps)
    if args.save_latents:
        save_file({"latents": latents.float().contiguous()}, str(args.save_latents))
    if args.save_frames:
        save_file({"frames": frames.float().contiguous()}, str(args.save_frames))
    seconds = time.perf_counter() - started
    print(f"wrote {args.out} ({frames.shape[0]} frames, {args.width}x{args.height}, {config.describe()}) in {seconds:.1f} s")


def _run(runner: PoolRunner, args, files, shape, vace: VaceInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Text encoding, (VACE encoding,) sampling and decoding; the latents come back with reference frames trimmed.

    Without VACE each model is unloaded once its part is done; with VACE the VAE encodes before sampling and
    stays loaded for the decode."""
    prompts = _encode_prompts(runner, args, files)
    vae = runner.load_vae(files["vae"], dtype=args.dtype) if vace is not None else None
    encoded = vace.encode(runner, vae, args) if vace is not None else None
    latents = _sample(runner, args, files, shape, prompts, vace, encoded)
    vae = vae or runner.load_vae(files["vae"], dtype=args.dtype)
    frames = runner.decode(vae, latents, tile_px=args.vae_tile, overlap_px=args.vae_overlap)
    return frames, latents


def _sample(runner: PoolRunner, args, files, shape, prompts, vace: VaceInputs | None, encoded) -> torch.Tensor:
    """The sampled latents; with VACE the latent starts with the reference frames, which are trimmed off after."""
    fields, trim = {}, 0
    if encoded is not None:
        fields, trim = vace.sample_fields(encoded), encoded.trim_latent
        shape = (*shape[:2], encoded.frames.shape[2], *shape[3:])
    model = runner.load_model(files["model"], vace_module=files["vace_module"], dtype=args.dtype)
    request = SampleRequest(
        handle=model, latent=torch.zeros(shape), positive=prompts[0], negative=prompts[1], seed=args.seed,
        steps=args.steps, guidance_scale=args.guidance_scale, shift=args.shift, sampler=args.sampler, **fields,
    )
    latents = runner.sample(request, progress=_progress)[:, :, trim:]
    runner.unload(model)
    return latents


def _encode_prompts(runner: PoolRunner, args, files) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    text = runner.load_text_encoder(files["text_encoder"], dtype=args.dtype)
    positive, negative = runner.encode_text(text, [args.prompt]), runner.encode_text(text, [args.negative])
    runner.unload(text)
    return positive, negative
