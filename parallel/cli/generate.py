"""`wanmesh generate`: text to video (and VACE video editing) through the worker pool, writing an MP4 and
optionally latents, frames and the VACE context.

Runs in the CLI (driver) process; all model work happens in the pool's workers. Order of work, so that
nothing is lost and mistakes fail early: every input is validated (``validation.py``: sizes, numbers, file
headers, head split, output folders) before the pool starts; the VAE is loaded before sampling (a wrong
--vae fails first); the latents are written (atomically) before decoding; the MP4 is written atomically.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ..config import T2V_EXPERT_BOUNDARY, ParallelConfig, check_experts, check_step_range, latent_shape
from ..driver.pool import WorkerPool
from ..driver.runner import PoolRunner
from ..driver.timings import RunTimings
from ..protocol import SampleRequest
from ..cache_settings import cache_fields, describe_report, parse_cache
from ..tensor_files import save_tensors_atomic
from ..validation import GenerateInputs, check_model_file, validate_generate
from ..video_io import CONTAINERS, check_fps
from .layout import auto_layout_config
from .image_inputs import ImageInputs
from .vace_inputs import VaceInputs, VaceSources
from .plan import ModelFiles, check_output_space, generate_output_sizes, plan_line, step_estimate
from .progress import Progress, finished
from .video_file import write_mp4

SAFETENSORS = (".safetensors",)


def pool_config(args) -> ParallelConfig:
    """The worker pool the command line asked for (flags of `cli.add_pool_arguments`), checked before any process
    starts."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but this machine has no CUDA device; use --device cpu")
    return ParallelConfig(
        world=args.world, tp=args.tp, ulysses=args.ulysses, ring=args.ring, cfg_parallel=args.cfg_parallel,
        vae_patch=args.vae_patch, devices=args.device or "auto", memory_budget_gb=args.memory_budget_gb,
        worker_timeout=args.worker_timeout, backend=args.backend, ray_address=args.ray_address or None,
    )


def generate_inputs(args, files: dict[str, str | None]) -> GenerateInputs:
    outputs = {"--out": (args.out, tuple(CONTAINERS)), "--save-latents": (args.save_latents, SAFETENSORS),
               "--save-frames": (args.save_frames, SAFETENSORS), "--save-vace": (getattr(args, "save_vace", None), SAFETENSORS)}
    return GenerateInputs(
        width=args.width, height=args.height, frames=args.frames, steps=args.steps, shift=args.shift,
        guidance_scale=args.guidance_scale, seed=args.seed, sampler=args.sampler, prompts=(args.prompt, args.negative),
        model=files["model"], vae=files["vae"], text_encoder=files["text_encoder"], vace_module=files["vace_module"],
        outputs=outputs, tile_px=args.vae_tile, overlap_px=args.vae_overlap,
    )


def check_generate(args, files: dict[str, str | None]) -> ParallelConfig:
    """The validation pass: raises a one-line ValueError, prints warnings; no process started, no model read."""
    config = pool_config(args)
    check_fps(args.fps)
    warnings = validate_generate(generate_inputs(args, files), config)
    experts = _expert_fields(args)  # bad boundaries and step ranges fail before the pool starts
    check_experts(boundary=experts["boundary"], guidance_scale_low=experts["guidance_scale_low"])
    check_step_range(experts["start_step"], experts["end_step"], args.steps)
    parse_cache(getattr(args, "cache", None))
    if files.get("model_low"):
        check_model_file(files["model_low"], "model", "--model-low", config)
    for warning in warnings:
        print(f"wanmesh: warning: {warning}", file=sys.stderr, flush=True)
    return config


def generate(args, files: ModelFiles, vace: VaceSources | None = None, image: ImageInputs | None = None,
             defaults: str = "") -> None:
    """Validate, say the plan, sample, save the latents, decode and write; every input is checked (and the
    outputs' free space) before the pool starts."""
    progress = Progress(args.quiet)
    paths = files.paths
    inputs = vace.build(args.width, args.height, args.frames) if vace is not None else None
    config = auto_layout_config(args, paths["model"], check_generate(args, paths), streaming=False)
    shape = latent_shape(args.width, args.height, args.frames)
    progress.say(plan_line(args, files, config, defaults))
    estimate = step_estimate(args, paths["model"], config) if not args.quiet else None
    if estimate:
        progress.say(estimate)
    check_output_space(generate_output_sizes(args, math.prod(shape)))
    timings = RunTimings()
    with progress.phase(f"start pool ({config.world} rank{'s' * (config.world > 1)})", timings, "pool_start"):
        workers = WorkerPool(config)
    with workers as pool:
        latents, frames = _run(PoolRunner(pool), args, paths, shape, inputs, timings, image, progress)
    with progress.phase(f"write {args.out}", timings, "write"):
        write_outputs(args, latents, frames)
    if args.timings:
        timings.write(args.timings)
        print(f"  timings: {timings.summary()}", file=sys.stderr)
    finished(f"wrote {args.out} ({frames.shape[0]} frames, {args.width}x{args.height}, {config.describe()})")


def write_outputs(args, latents: torch.Tensor, frames: torch.Tensor) -> None:
    """The MP4 (and --save-frames); a failure names the path the user gave and where the latents are kept (the
    --save-latents file, or one written beside --out or in the temporary folder for the purpose)."""
    writes = [(args.out, lambda: write_mp4(frames, args.out, fps=args.fps))]
    if args.save_frames:
        writes.append((args.save_frames, lambda: save_tensors_atomic({"frames": frames.float()}, args.save_frames)))
    for path, write in writes:
        try:
            write()
        except OSError as error:
            raise OSError(error.errno, f"{error.strerror or error}: {path}{_kept_latents(args, latents)}") from None


def _kept_latents(args, latents: torch.Tensor) -> str:
    if args.save_latents and Path(args.save_latents).is_file():
        return f"; the latents are kept in {args.save_latents}"
    for folder in (Path(args.out).parent, Path(tempfile.gettempdir())):
        path = folder / f"{Path(args.out).stem}.latents.safetensors"
        try:
            save_tensors_atomic({"latents": latents.float()}, path)
            return f"; the latents are kept in {path}"
        except OSError:
            continue
    return "; the latents could not be kept either"


def _run(runner: PoolRunner, args, files, shape, vace: VaceInputs | None, timings: RunTimings,
         image: ImageInputs | None, progress: Progress) -> tuple[torch.Tensor, torch.Tensor]:
    """Text encoding, VAE load (before sampling, so a bad VAE fails first), (VACE or image encoding,) sampling,
    saving the latents (before decoding, so a failed decode never loses them) and decoding."""
    with progress.phase("encode text", timings, "text_encode"):
        prompts = encode_prompts(runner, args, files)
    with progress.phase("load VAE", timings, "vae_load"):
        vae = runner.load_vae(files["vae"], dtype=args.dtype)
    encoded = None
    if vace is not None:
        with progress.phase("encode VACE context", timings, "vae_encode"):
            encoded = vace.encode(runner, vae, args)
    image_fields = {}
    if image is not None:
        with progress.phase("encode image", timings, "vae_encode"):
            image_fields = image.sample_fields(runner, vae, args)
    latents = _sample(runner, args, files, shape, prompts, vace, encoded, timings, image_fields, progress)
    if args.save_latents:
        save_tensors_atomic({"latents": latents.float()}, args.save_latents)
    with progress.phase("decode", timings, "vae_decode"):
        return latents, runner.decode(vae, latents, tile_px=args.vae_tile, overlap_px=args.vae_overlap)


def _sample(runner: PoolRunner, args, files, shape, prompts, vace: VaceInputs | None, encoded,
            timings: RunTimings, image_fields: dict | None = None, progress: Progress | None = None) -> torch.Tensor:
    """The sampled latents; with VACE the latent starts with the reference frames, which are trimmed off after."""
    progress = progress or Progress(quiet=True)
    fields, trim = dict(image_fields or {}), 0
    if encoded is not None:
        fields, trim = vace.sample_fields(encoded), encoded.trim_latent
        shape = (*shape[:2], encoded.frames.shape[2], *shape[3:])
    request = SampleRequest(
        handle="", latent=fields.pop("latent") if "latent" in fields else torch.zeros(shape), positive=prompts[0],
        negative=prompts[1], seed=args.seed,
        steps=args.steps, guidance_scale=args.guidance_scale, shift=args.shift, sampler=args.sampler,
        scheduler=args.scheduler, timings=args.timings is not None,
        cache=cache_fields(parse_cache(getattr(args, "cache", None))), **fields,
        **_expert_fields(args),
    )
    with progress.phase("load model", timings, "weight_load"):
        model = runner.load_model(files["model"], vace_module=files["vace_module"], dtype=args.dtype,
                                  weights=args.weights)
        low = None
        if files.get("model_low"):
            low = runner.load_model(files["model_low"], vace_module=files["vace_module"], dtype=args.dtype,
                                    weights=args.weights)
    loras = {model: list(files.get("loras") or [])}  # --lora applies to --model (the high-noise expert)
    with progress.phase(f"sample ({args.steps} steps)", timings, "sampling"):
        reply = runner.sample_reply(replace(request, handle=model, handle_low=low, model_loras=loras),
                                    progress=progress.steps("sample"))
    timings.add_sampling(reply.rank_timings)
    if reply.expert_steps:
        progress.say(f"  {reply.expert_steps}")
    if reply.cache_report:
        progress.say(f"  {describe_report(reply.cache_report)}")
    for handle in (model, low):
        if handle is not None:
            runner.unload(handle)
    return reply.latents[:, :, trim:]


def _expert_fields(args) -> dict:
    """The two-expert and step-range settings of the command line (defaults when a flag is absent)."""
    return {"boundary": getattr(args, "boundary", T2V_EXPERT_BOUNDARY), "start_step": getattr(args, "start_step", 0),
            "guidance_scale_low": getattr(args, "guidance_scale_low", None), "end_step": getattr(args, "end_step", None)}


def encode_prompts(runner: PoolRunner, args, files, more: list[str] = (),
                   text_encoder: str | None = None) -> list[list[torch.Tensor]]:
    """--prompt, --negative and the ``more`` prompts (in order) embedded by the pool's text encoder: the loaded
    ``text_encoder`` handle, kept; else the file's, loaded for this and unloaded afterwards."""
    text = text_encoder or runner.load_text_encoder(files["text_encoder"], dtype=args.dtype)
    embedded = [runner.encode_text(text, [prompt]) for prompt in (args.prompt, args.negative, *more)]
    if text_encoder is None:
        runner.unload(text)
    return embedded
