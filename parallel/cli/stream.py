"""`wanmesh stream`: causal (chunk by chunk) text to video, or from a start image (``--image``, as ComfyUI's
ARVideoI2V), through the worker pool; runs in the CLI (driver) process.

Each chunk is decoded by the workers' streaming VAE as soon as its denoising steps are done and written to
``--chunk-dir`` (chunk_000.mp4, chunk_001.mp4, ...) the moment it arrives, with its latency printed; then the
whole video goes to ``--out``. Every option is checked before the pool starts.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from ..cache_settings import cache_fields, check_stream_cache, describe_report, parse_cache
from ..config import (check_prompt_switches, check_sampling, check_stream_layout, check_stream_options,
                      check_stream_start, latent_shape, parse_stream_timesteps)
from ..driver.live_prompts import LivePrompts, StreamEnded
from ..driver.pool import WorkerPool
from ..driver.runner import PoolRunner
from ..driver.timings import RunTimings
from ..driver.stream_chunks import ChunkFolder, StreamChunk
from ..image_to_video import stream_start_frame
from ..protocol import StreamSample
from ..tensor_files import save_tensors_atomic
from ..validation import check_chunk_folder, check_model_file, check_model_partners, check_output_path
from ..video_io import CONTAINERS, check_fps
from .parser import add_stream_arguments as add_arguments  # noqa: F401 - the parser's
from .generate import encode_prompts, pool_config
from .layout import auto_layout_config
from .media import read_image
from .plan import ModelFiles, plan_line, step_estimate
from .progress import Progress, finished
from .video_file import write_mp4

def check_stream_arguments(args) -> tuple[int, ...]:
    """Every option that can be checked without a model; the latent shape when all are good."""
    shape = latent_shape(args.width, args.height, args.frames)
    check_sampling(sampler="euler", steps=args.steps, shift=args.shift, denoise=1.0,
                   guidance_scale=args.guidance_scale)
    check_stream_options(shape[2], args.chunk, args.kv_window, args.sink, args.reanchor, not args.no_kv_cache)
    args.step_cache = parse_cache(getattr(args, "cache", None))
    check_stream_cache(args.step_cache, not args.no_kv_cache)
    args.start_image = None
    if args.image is not None:
        check_stream_start(1, shape[2], args.kv_window, args.sink)  # one image: one latent frame
        args.start_image = read_image(args.image, "--image")
    args.timesteps = parse_stream_timesteps(args.timesteps) if isinstance(args.timesteps, str) else args.timesteps
    args.prompt_switches = parse_prompt_switches(getattr(args, "prompt_at", []))
    check_prompt_switches(list(args.prompt_switches), shape[2], args.chunk, 1 if args.start_image is not None else 0)
    check_fps(args.fps)
    pool_config(args)  # the layout (world, tp, ulysses) and the device
    check_stream_layout(ring=args.ring, cfg_parallel=args.cfg_parallel)
    return shape


def read_live_prompts(lines, progress: Progress) -> LivePrompts:
    """``--live-prompts``: each non-empty line of ``lines`` (standard input) is posted to the stream as it is read;
    where it applied (or why it did not) is printed. The reader is a daemon thread: it ends with the command."""
    live = LivePrompts()

    def report(text: str, future) -> None:
        try:
            progress.say(f"  prompt switched at chunk {future.result()}: {text}")
        except StreamEnded as ended:
            progress.say(f"  prompt not applied ({ended}): {text}")

    def read() -> None:
        for line in lines:
            text = line.strip()
            if not text:
                continue
            try:
                future = live.post(text)
            except StreamEnded:
                return
            future.add_done_callback(lambda done, text=text: report(text, done))

    threading.Thread(target=read, name="wanmesh-live-prompts", daemon=True).start()
    return live


def parse_prompt_switches(values: list[str]) -> dict[int, str]:
    """``--prompt-at CHUNK:PROMPT`` values as {chunk: prompt}, in chunk order; one line naming a bad value."""
    switches: dict[int, str] = {}
    for value in values:
        index, colon, prompt = value.partition(":")
        if not colon or not index.strip().isdigit() or not prompt.strip():
            raise ValueError(f"--prompt-at {value!r} is not valid; valid: CHUNK:PROMPT, e.g. --prompt-at "
                             "'4:a cat walks in the snow' (a chunk index and a non-empty prompt)")
        if int(index) in switches:
            raise ValueError(f"--prompt-at gives chunk {int(index)} twice; give one prompt per chunk")
        switches[int(index)] = prompt.strip()
    return dict(sorted(switches.items()))


class ChunkWriter:
    """``on_chunk``: writes each decoded chunk to DIR/chunk_NNN.mp4 at once and prints its latency. A chunk that
    cannot be written there (DIR deleted or unwritable meanwhile) is a warning at once and is kept
    (``driver/stream_chunks.ChunkFolder``); ``finish`` fails naming the chunk files DIR still lacks."""

    def __init__(self, folder: Path, fps: int, started: float, progress: Progress | None = None,
                 timings: RunTimings | None = None):
        self.folder, self.fps, self.started = folder, fps, started
        self.timings = timings if timings is not None else RunTimings()
        self.progress = progress or Progress(quiet=False)
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
        last_frame = chunk.start_frame + chunk.latents.shape[2] - 1
        self.timings.chunks.append({
            "index": chunk.index, "latent_frames": [chunk.start_frame, last_frame],
            "frames": 0 if chunk.frames is None else int(chunk.frames.shape[0]),
            "latency_s": now - self.last, "since_start_s": now - self.started})
        self.progress.close_bar()
        if not self.progress.quiet:
            print(f"chunk {chunk.index}: latent frames {chunk.start_frame}..{last_frame}"
                  f", {0 if chunk.frames is None else chunk.frames.shape[0]} frames, {now - self.last:.2f} s "
                  f"(since start {now - self.started:.2f} s) -> {where}", flush=True)
        self.last = now


def check_stream_files(args, files: dict[str, str | None], config) -> None:
    """The validation pass's file checks (headers only) and output paths, before any pool starts."""
    for role, flag in (("model", "--model"), ("vae", "--vae"), ("text_encoder", "--text-encoder")):
        check_model_file(files[role], role, flag, config if role in ("model", "text_encoder") else None)
    check_model_partners(files["model"], "--model", vae=(files["vae"], "--vae"),
                         text_encoder=(files["text_encoder"], "--text-encoder"))
    check_output_path(args.out, "--out", tuple(CONTAINERS))
    check_chunk_folder(args.chunk_dir, "--chunk-dir")
    if args.save_latents:
        check_output_path(args.save_latents, "--save-latents", (".safetensors",))


def stream(args, files: ModelFiles, defaults: str = "") -> None:
    """Check, say the plan, start the pool, stream the chunks into --chunk-dir, write --out (and
    --save-latents)."""
    progress = Progress(args.quiet)
    shape = check_stream_arguments(args)
    config = pool_config(args)
    paths = files.paths
    check_stream_files(args, paths, config)
    config = auto_layout_config(args, paths["model"], config, streaming=True)
    progress.say(plan_line(args, files, config, defaults, command="stream"))
    estimate = step_estimate(args, paths["model"], config) if not args.quiet else None
    if estimate:
        progress.say(estimate)
    args.chunk_dir.mkdir(parents=True, exist_ok=True)
    timings = RunTimings()
    with progress.phase(f"start pool ({config.world} rank{'s' * (config.world > 1)})", timings, "pool_start"):
        workers = WorkerPool(config)
    with workers as pool:
        runner = PoolRunner(pool)
        with progress.phase("encode text", timings, "text_encode"):
            # --live-prompts keeps the text encoder loaded: the ranks encode each prompt read while streaming
            live_encoder = runner.load_text_encoder(paths["text_encoder"], dtype=args.dtype) if args.live_prompts else None
            prompts = encode_prompts(runner, args, paths, list(args.prompt_switches.values()), live_encoder)
        with progress.phase("load model and VAE", timings, "weight_load"):
            model = runner.load_model(paths["model"], dtype=args.dtype, weights=args.weights)
            vae = runner.load_vae(paths["vae"], dtype=args.dtype)
        start_latent = None
        if args.start_image is not None:
            with progress.phase("encode start image", timings, "vae_encode"):
                start_latent = runner.encode(vae, stream_start_frame(args.start_image, args.width, args.height))
        request = StreamSample(
            handle=model, latent=torch.zeros(shape), positive=prompts[0], negative=prompts[1], seed=args.seed,
            steps=args.steps, shift=args.shift, timesteps=args.timesteps, guidance_scale=args.guidance_scale,
            chunk=args.chunk, kv_window=args.kv_window, sink=args.sink, reanchor=args.reanchor,
            use_cache=not args.no_kv_cache,
            vae_handle=vae, preview=True, start_latent=start_latent, cache=cache_fields(args.step_cache),
            switch_chunks=list(args.prompt_switches), switch_positive=prompts[2:], live_text_encoder=live_encoder,
        )
        live = read_live_prompts(sys.stdin, progress) if args.live_prompts else None
        with progress.phase(f"stream ({shape[2]} latent frames, chunks of {args.chunk})", timings, "streaming"):
            started = time.perf_counter()  # inside the phase: every chunk's time since start is within it
            writer = ChunkWriter(args.chunk_dir, args.fps, started, progress, timings)
            try:
                result = runner.stream(request, on_chunk=writer, progress=progress.steps("chunk"), live=live)
            finally:
                if live is not None:
                    live.close("the stream ended before a later chunk")
        if result.cache_report:
            progress.say(f"  {describe_report(result.cache_report)}")
    with progress.phase(f"write {args.out}", timings, "write"):
        if args.save_latents:  # latents before the video, so a failed write still leaves them
            save_tensors_atomic({"latents": result.latents.float()}, args.save_latents)
        write_mp4(result.frames, args.out, fps=args.fps)
        writer.finish(args.out)
    if args.timings:
        timings.write(args.timings)
        print(f"  timings: {timings.summary()}", file=sys.stderr)
    finished(f"wrote {args.out} ({result.frames.shape[0]} frames, {len(writer.written)} chunks, "
             f"{config.describe()}; streaming {time.perf_counter() - started:.1f} s)")
