"""`wanmesh bench dit`: one denoise step of WanMesh against diffusers' own transformer forward, same weights and shapes;
with ``--vace`` also the VACE step (one and two contexts) against the T2V step and the VACE encode on the worker pool;
runs in the CLI process (the encode rows in the pool's worker processes).

WanMesh's step is what the sampler runs (CFG: two model passes, the guidance mix and the scheduler update);
diffusers' reference is its WanTransformer3DModel called twice on the same inputs. The ratio shows what
WanMesh adds or saves around the transformer. Every row is timed by one harness: one warm-up call each, then
``--repeats`` rounds that call the compared functions in turn (interleaved, so drifting machine load hits all
rows alike); the table gives the median and the fastest and slowest round.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .common import Timing, time_interleaved
from .releases import WAN_1_3B, WAN_VACE_1_3B

SIZES = {"tiny": (128, 96, 17), "1.3b": (832, 480, 81)}  # width, height, frames of the denoise step
ENCODE_SIZES = {"tiny": (96, 64, 9), "1.3b": (832, 480, 81)}  # of the VACE encode (the tiny VAE is slow on a CPU)
VACE_TILES = (32, 64)  # VAE tile edges (px) of the encode rows
GUIDANCE_SCALE = 5.0


def add_arguments(parser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--shape", choices=["tiny", "1.3b"], default="tiny",
                        help="tiny: the built-in tiny models (default 128x96, 17 frames); "
                             "1.3b: Wan 1.3B with random weights (default 832x480, 81 frames)")
    parser.add_argument("--size", metavar="WxHxF", help="video width x height x frames of the denoise step instead of "
                        "the shape's default")
    parser.add_argument("--encode-size", metavar="WxHxF", help="video size of the --vace encode rows "
                        "(default: 96x64x9 for tiny, 832x480x81 for 1.3b)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median, min and max are shown)")
    parser.add_argument("--models", type=Path, help="tiny models tree (default: the cache folder)")
    parser.add_argument("--vace", action="store_true",
                        help="also time the VACE step with 1 and 2 contexts against the T2V step, and the VACE encode "
                             "on the pool with vae_patch 1 and 2 (tiles of 32 and 64 px, the tiny VAE)")


# -- sizes and models ----------------------------------------------------------------------------------


def video_size(text: str | None, flag: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """(width, height, frames) from a WIDTHxHEIGHTxFRAMES flag or the default; checked like every video size."""
    from ..config import check_video_size

    if text is None:
        return default
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"{flag} takes WIDTHxHEIGHTxFRAMES, e.g. 64x48x5, got {text!r}")
    width, height, frames = (int(part) for part in parts)
    check_video_size(width, height, frames)
    return width, height, frames


def _tiny_root(args) -> Path:
    from ..tiny.files import ensure_tiny_models, tiny_cache_dir

    return ensure_tiny_models(args.models or tiny_cache_dir())


def _tiny_models(args, device, vace: bool):
    from ..tiny.files import TINY_FILES
    from ..weights.loaders import load_transformer

    root = _tiny_root(args)
    ours = load_transformer(str(root / TINY_FILES["model"]), device=device)
    reference = load_transformer(str(root / "diffusers" / "wan_tiny_t2v"), device=device)
    vace_model = load_transformer(str(root / TINY_FILES["vace"]), device=device) if vace else None
    return ours, reference, vace_model, torch.float32


def _wan_1_3b(device, vace: bool):
    from diffusers import WanTransformer3DModel

    from ..networks.wan_vace import WanVaceMultiContext

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_1_3B).to(device=device, dtype=torch.bfloat16).eval()
    vace_model = WanVaceMultiContext(**WAN_VACE_1_3B).to(device=device, dtype=torch.bfloat16).eval() if vace else None
    return model, model, vace_model, torch.bfloat16


# -- the denoise step ----------------------------------------------------------------------------------


@dataclass
class StepInputs:
    latents: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor
    t: torch.Tensor
    scheduler: object
    dtype: torch.dtype


def _step_inputs(shape, text_dim: int, device, dtype) -> StepInputs:
    from ..sampling.loop import make_scheduler

    generator = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(shape, generator=generator).to(device)
    context = torch.randn(2, 512, text_dim, generator=generator).to(device, dtype)
    scheduler = make_scheduler("flow_euler", 5.0)
    scheduler.set_timesteps(1000, device="cpu")
    return StepInputs(latents, context[:1], context[1:], scheduler.timesteps[500], scheduler, dtype)


def _wanmesh_step(model, inputs: StepInputs, extra: dict, preview: bool = False) -> Callable[[], None]:
    """One sampler step: two guided passes, the guidance mix, the live preview when asked (as rank 0 makes it)
    and the scheduler update (the same step each call)."""
    from ..sampling.guidance import guided_prediction
    from ..sampling.preview import denoised_estimate, preview_image

    def step():
        inputs.scheduler._step_index = 500
        prediction = guided_prediction(model, inputs.latents.to(inputs.dtype), inputs.t, inputs.positive,
                                       inputs.negative, GUIDANCE_SCALE, extra)
        if preview:
            preview_image(denoised_estimate(inputs.latents, prediction, inputs.t))
        inputs.scheduler.step(prediction.float(), inputs.t, inputs.latents, return_dict=False)

    return step


def _diffusers_forward(reference, inputs: StepInputs) -> Callable[[], None]:
    def forward():
        timestep = inputs.t.expand(1).to(inputs.latents.device)
        for ctx in (inputs.positive, inputs.negative):
            reference(hidden_states=inputs.latents.to(inputs.dtype), timestep=timestep, encoder_hidden_states=ctx,
                      return_dict=False)

    return forward


def _vace_extra(model, inputs: StepInputs, contexts: int) -> dict:
    """The VACE keyword arguments the sampler builds (once per sample) for `contexts` random contexts."""
    from ..protocol import SampleRequest
    from ..sampling.loop import vace_model_inputs

    batch, _, frames, h, w = inputs.latents.shape
    generator = torch.Generator("cpu").manual_seed(1)
    vace_frames = [torch.randn(1, 32, frames, h, w, generator=generator) for _ in range(contexts)]
    vace_masks = [(torch.rand(1, 64, frames, h, w, generator=generator) > 0.5).float() for _ in range(contexts)]
    request = SampleRequest(handle="bench", latent=inputs.latents.cpu(), positive=[inputs.positive[0].cpu()],
                            negative=[inputs.negative[0].cpu()], seed=0, steps=1, guidance_scale=GUIDANCE_SCALE,
                            shift=5.0, vace_frames=vace_frames, vace_masks=vace_masks,
                            vace_strengths=[1.0] * contexts)
    request.validate()
    return vace_model_inputs(model, request, range(batch), inputs.dtype, inputs.latents.device)


def _step_functions(ours, reference, vace_model, inputs: StepInputs) -> dict[str, Callable[[], None]]:
    functions = {"WanMesh denoise step (T2V)": _wanmesh_step(ours, inputs, {}),
                 "WanMesh step with live preview": _wanmesh_step(ours, inputs, {}, preview=True),
                 "diffusers transformer forward x2": _diffusers_forward(reference, inputs)}
    if vace_model is not None:
        for contexts in (1, 2):
            name = f"VACE denoise step, {contexts} context{'s' if contexts > 1 else ''}"
            functions[name] = _wanmesh_step(vace_model, inputs, _vace_extra(vace_model, inputs, contexts))
    return functions


def _step_table(timings: dict[str, Timing], title: str) -> str:
    lines = [title, f"{'what':<40}{'median s':>12}{'min s':>10}{'max s':>10}"]
    lines += [f"{name:<40}{t.median:>12.4f}{t.low:>10.4f}{t.high:>10.4f}" for name, t in timings.items()]
    t2v = timings["WanMesh denoise step (T2V)"].median
    lines.append(f"{'ratio WanMesh / diffusers':<40}{t2v / timings['diffusers transformer forward x2'].median:>12.3f}")
    lines.append(f"{'ratio with preview / without':<40}{timings['WanMesh step with live preview'].median / t2v:>12.3f}")
    for name, timing in timings.items():
        if name.startswith("VACE"):
            lines.append(f"{'ratio ' + name.removeprefix('VACE denoise step, ') + ' / T2V':<40}"
                         f"{timing.median / t2v:>12.3f}")
    return "\n".join(lines)


# -- the VACE encode on the pool ----------------------------------------------------------------------


def _encode_inputs(width: int, height: int, frames: int) -> dict:
    """A control video, a mask generating the right half, and one reference image (random, fixed seed)."""
    generator = torch.Generator("cpu").manual_seed(2)
    masks = torch.zeros(frames, height, width)
    masks[:, :, width // 2:] = 1.0
    return {"width": width, "height": height, "length": frames,
            "control_video": torch.rand(frames, height, width, 3, generator=generator), "control_masks": masks,
            "reference_images": torch.rand(1, height, width, 3, generator=generator)}


def _patch_sizes(device: torch.device) -> list[int]:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 2
    return [1, 2] if gpus >= 2 else [1]


def _encode_timings(args, device: torch.device, size) -> tuple[dict[str, Timing], list[int]]:
    """Time `encode_vace` through pools of 1 rank (vae_patch 1) and 2 ranks (vae_patch 2), interleaved."""
    from ..config import ParallelConfig
    from ..driver.pool import WorkerPool
    from ..driver.runner import PoolRunner
    from ..tiny.files import TINY_FILES
    from ..protocol import EncodeVace

    vae_file, inputs, patches = str(_tiny_root(args) / TINY_FILES["vae"]), _encode_inputs(*size), _patch_sizes(device)
    functions = {}
    with contextlib.ExitStack() as stack:
        for patch in patches:
            config = ParallelConfig(world=patch, vae_patch=patch, devices=device.type)
            runner = PoolRunner(stack.enter_context(WorkerPool(config)))
            vae = runner.load_vae(vae_file)
            for tile in ((None,) if patch == 1 else ()) + VACE_TILES:
                request = EncodeVace(handle=vae, tile_px=tile, **inputs)
                functions[f"{patch}|{tile or 'whole'}"] = lambda runner=runner, request=request: runner.encode_vace(request)
        return time_interleaved(functions, device, args.repeats), patches


def _encode_row_order(item) -> tuple[int, int]:
    patch, tile = item[0].split("|")
    return (0 if tile == "whole" else int(tile)), int(patch)


def _encode_table(timings: dict[str, Timing], patches: list[int], size, device) -> str:
    from ..config import resolve_tile_options

    width, height, frames = size
    title = (f"VACE encode (tiny VAE, auto dtype) on the pool, {device.type} ranks: {width}x{height}, {frames} frames, "
             f"a control video + mask + 1 reference image")
    lines = [title, f"{'vae_patch':>9}{'ranks':>7}{'tile px':>9}{'overlap px':>12}{'median s':>12}{'min s':>10}{'max s':>10}"]
    for key, t in sorted(timings.items(), key=_encode_row_order):
        patch, tile = key.split("|")
        overlap = "-" if tile == "whole" else str(resolve_tile_options(int(tile), None)[1])
        lines.append(f"{patch:>9}{patch:>7}{tile:>9}{overlap:>12}{t.median:>12.4f}{t.low:>10.4f}{t.high:>10.4f}")
    if patches == [1]:
        lines.append("vae_patch 2 skipped: it needs 2 devices")
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------------


def run(args) -> int:
    from ..config import latent_shape

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.shape == "1.3b" and device.type != "cuda":
        raise SystemExit("--shape 1.3b needs a CUDA device (about 20 GB); use --shape tiny on the CPU")
    size = video_size(args.size, "--size", SIZES[args.shape])
    encode_size = video_size(args.encode_size, "--encode-size", ENCODE_SIZES[args.shape])
    shape = latent_shape(*size)
    if args.shape == "tiny":
        ours, reference, vace_model, dtype = _tiny_models(args, device, args.vace)
    else:
        ours, reference, vace_model, dtype = _wan_1_3b(device, args.vace)
    inputs = _step_inputs(shape, ours.config.text_dim, device, dtype)
    with torch.no_grad():
        timings = time_interleaved(_step_functions(ours, reference, vace_model, inputs), device, args.repeats)
    tokens = shape[2] * shape[3] * shape[4] // 4
    print(_step_table(timings, f"bench dit: shape {args.shape}, {size[0]}x{size[1]}, {size[2]} frames, latents "
                               f"{list(shape)} ({tokens} tokens), {dtype}, {device}, CFG on (2 passes), "
                               f"{args.repeats} interleaved rounds after 1 warm-up"))
    if args.vace:
        encode_timings, patches = _encode_timings(args, device, encode_size)
        print()
        print(_encode_table(encode_timings, patches, encode_size, device))
    return 0
