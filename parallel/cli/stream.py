"""`wanmesh stream`: causal (chunk by chunk) text to video, or from a start image (``--image``, as ComfyUI's
ARVideoI2V), through the worker pool; runs in the CLI (driver) process.

Each chunk is decoded by the workers' streaming VAE as soon as its denoising steps are done and written to
``--chunk-dir`` (chunk_000.mp4, chunk_001.mp4, ...) the moment it arrives, with its latency printed; then the
whole video goes to ``--out``. Every option is checked before the pool starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..config import (check_sampling, check_stream_layout, check_stream_options, check_stream_start, latent_shape,
                      parse_stream_timesteps)
from ..driver.pool import WorkerPool
from ..driver.runner import PoolRunner
from ..driver.stream_chunks import ChunkFolder, StreamChunk
from ..image_to_video import stream_start_frame
from ..protocol import StreamSample
from ..tensor_files import save_tensors_atomic
from ..validation import check_chunk_folder, check_model_file, check_output_path, check_text_encoder_for_model
from ..video_io import CONTAINERS, check_fps
from ..fields import add_flag
from . import add_model_file_arguments, add_pool_arguments
from .generate import encode_prompts, pool_config
from .layout import auto_layout_config
from .media import read_image
from .video_file import write_mp4

def add_arguments(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("stream", help="causal streaming text to video: chunks written as they are made")
    add_model_file_arguments(p, "causal Wan 2.1 transformer (Self-Forcing, CausVid, ...): file or folder", "stream")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative", default="", help="negative prompt (used only with --cfg above 1)")
    for key in ("width", "height", "length", "chunk", "stream_steps", "stream_shift", "timesteps"):
        add_flag(p, key, "stream")
    add_flag(p, "stream_cfg", "stream", "--cfg", dest="guidance_scale")
    add_flag(p, "kv_window", "stream")
    add_flag(p, "sink", "stream")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="recompute all earlier chunks every time (the reference the cache must equal)")
    p.add_argument("--image", help="start image: the stream starts from it (as ComfyUI's ARVideoI2V): resized and "
                   "center-cropped to the video, its latent frame written to the KV cache first")
    add_flag(p, "seed", "stream")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    add_flag(p, "dtype", "stream")
    add_pool_arguments(p, "stream")
    p.set_defaults(vace_module=None)
    add_flag(p, "fps", "stream")
    p.add_argument("--out", type=Path, required=True, help="the MP4 file of the whole video")
    p.add_argument("--chunk-dir", type=Path, required=True, help="folder for chunk_000.mp4, chunk_001.mp4, ...")
    p.add_argument("--save-latents", type=Path, help="write the raw latents [B,16,T,h,w] as tensor 'latents'")
    return p


def check_stream_arguments(args) -> tuple[int, ...]:
    """Every option that can be checked without a model; the latent shape when all are good."""
    shape = latent_shape(args.width, args.height, args.frames)
    check_sampling(sampler="euler", steps=args.steps, shift=args.shift, denoise=1.0,
                   guidance_scale=args.guidance_scale)
    check_stream_options(shape[2], args.chunk, args.kv_window, args.sink)
    args.start_image = None
    if args.image is not None:
        check_stream_start(1, shape[2], args.kv_window, args.sink)  # one image: one latent frame
        args.start_image = read_image(args.image, "--image")
    args.timesteps = parse_stream_timesteps(args.timesteps) if isinstance(args.timesteps, str) else args.timesteps
    check_fps(args.fps)
    pool_config(args)  # the layout (world, tp, ulysses) and the device
    check_stream_layout(ring=args.ring, cfg_parallel=args.cfg_parallel)
    return shape


class ChunkWriter:
    """``on_chunk``: writes each decoded chunk to DIR/chunk_NNN.mp4 at once and prints its latency. A chunk that
    cannot be written there (DIR deleted or unwritable meanwhile) is a warning at once and is kept
    (``driver/stream_chunks.ChunkFolder``); ``finish`` fails naming the chunk files DIR still lacks."""

    def __init__(self, folder: Path, fps: int, started: float):
        self.folder, self.fps, self.started = folder, fps, started
        self.last = started
        self.written: list[Path] = []
        self.files = ChunkFolder(folder, lambda frames, path: write_mp4(frames, path, fps=fps),
                                 lambda warning: print(f"wanmesh: warning: {warning}", file=sys.stderr, flush=True))

    def finish(self, whole_video: Path) -> None:
        self.files.finish(whole_video)

    def __call__(self, chunk: StreamChunk) -> None:
        now = time.perf_counter()
        path = self.folder / f"chunk_{chunk.index:03d}.mp4"
        if chunk.frames is not None:
            self.files.add(path.name, chunk.frames)
            self.written.append(path)
        where = path if path.is_file() else "kept in memory"
        print(f"chunk {chunk.index}: latent frames {chunk.start_frame}..{chunk.start_frame + chunk.latents.shape[2] - 1}"
              f", {0 if chunk.frames is None else chunk.frames.shape[0]} frames, {now - self.last:.2f} s "
              f"(since start {now - self.started:.2f} s) -> {where}", flush=True)
        self.last = now


def check_stream_files(args, files: dict[str, str | None], config) -> None:
    """The validation pass's file checks (headers only) and output paths, before any pool starts."""
    for role, flag in (("model", "--model"), ("vae", "--vae"), ("text_encoder", "--text-encoder")):
        check_model_file(files[role], role, flag, config if role in ("model", "text_encoder") else None)
    check_text_encoder_for_model(files["text_encoder"], files["model"], "--text-encoder", "--model")
    check_output_path(args.out, "--out", tuple(CONTAINERS))
    check_chunk_folder(args.chunk_dir, "--chunk-dir")
    if args.save_latents:
        check_output_path(args.save_latents, "--save-latents", (".safetensors",))


def stream(args, files: dict[str, str | None]) -> None:
    """Check, start the pool, stream the chunks into --chunk-dir, write --out (and --save-latents)."""
    shape = check_stream_arguments(args)
    config = pool_config(args)
    check_stream_files(args, files, config)
    config = auto_layout_config(args, files["model"], config, streaming=True)
    args.chunk_dir.mkdir(parents=True, exist_ok=True)
    with WorkerPool(config) as pool:
        runner = PoolRunner(pool)
        prompts = encode_prompts(runner, args, files)
        model = runner.load_model(files["model"], dtype=args.dtype, weights=args.weights)
        vae = runner.load_vae(files["vae"], dtype=args.dtype)
        start_latent = None
        if args.start_image is not None:
            start_latent = runner.encode(vae, stream_start_frame(args.start_image, args.width, args.height))
        request = StreamSample(
            handle=model, latent=torch.zeros(shape), positive=prompts[0], negative=prompts[1], seed=args.seed,
            steps=args.steps, shift=args.shift, timesteps=args.timesteps, guidance_scale=args.guidance_scale,
            chunk=args.chunk, kv_window=args.kv_window, sink=args.sink, use_cache=not args.no_kv_cache,
            vae_handle=vae, preview=True, start_latent=start_latent,
        )
        started = time.perf_counter()
        writer = ChunkWriter(args.chunk_dir, args.fps, started)
        result = runner.stream(request, on_chunk=writer)
    if args.save_latents:  # latents before the video, so a failed write still leaves them
        save_tensors_atomic({"latents": result.latents.float()}, args.save_latents)
    write_mp4(result.frames, args.out, fps=args.fps)
    writer.finish(args.out)
    seconds = time.perf_counter() - started
    print(f"wrote {args.out} ({result.frames.shape[0]} frames, {len(writer.written)} chunks, "
          f"{config.describe()}) in {seconds:.1f} s", file=sys.stdout)
