"""What `wanmesh generate` and `wanmesh stream` will do, settled before any work, in the CLI process.

* ``quick_checks``: the values given on the command line (sizes, steps, sampler, numbers, the pool's degrees),
  checked with ``config.py``'s checks before anything heavy loads (no torch, no model library), so that a typo
  is refused at once.
* ``resolve_model_files``: the model files, composed: ``--models DIR`` (or the tiny built-in set) gives every
  file, each single-file flag replaces one; ``--model`` alone takes the VAE and text encoder of its kind (latent
  channels, text width) from the same ComfyUI folder layout, else (a small test model only) from the tiny
  built-in set. Each file's source
  is kept for the plan line.
* ``model_defaults``: the size, frames, steps and shift not given, from the model's class (its header's width:
  a Wan release or a small test model).
* ``plan_line``: one line with all of it; on a CPU with a Wan release's size, an estimate of the time per step
  and a hint for a quick try.
* ``check_output_space``: the outputs' expected sizes against the free space of their file systems.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ParallelConfig, check_sampling, check_seed, check_steps, check_tiles, check_video_size
from ..tiny.files import TINY_FILES, ensure_tiny_models, tiny_cache_dir
from .parser import REAL_DEFAULTS, REAL_STREAM_DEFAULTS, TINY_DEFAULTS, TINY_STREAM_DEFAULTS, wants_image, wants_vace

SMALL_MODEL_DIM = 1536  # a transformer narrower than Wan 2.1 1.3B's 1536 is a small test model (tiny, medium)
QUICK_TRY = "--width 256 --height 160 --frames 9 --steps 10"
ROLE_FLAGS = {"model": "--model", "vae": "--vae", "text_encoder": "--text-encoder", "clip_vision": "--clip-vision",
              "model_low": "--model-low", "vace_module": "--vace-module"}
FOLDERS = {"vae": ("vae",), "text_encoder": ("text_encoders", "clip")}


def quick_checks(args) -> None:
    """The values the user gave, by ``config.py``'s checks; none of them loads torch."""
    given = lambda key, fallback: fallback if getattr(args, key, None) is None else getattr(args, key)  # noqa: E731
    check_video_size(given("width", 16), given("height", 16), given("frames", 1))
    if args.steps is not None:
        check_steps(args.steps)
    check_sampling(sampler=getattr(args, "sampler", None) or "euler", steps=given("steps", 1),
                   shift=given("shift", 1.0), denoise=1.0, guidance_scale=args.guidance_scale,
                   scheduler=getattr(args, "scheduler", None) or "simple")
    check_seed(args.seed)
    check_tiles(getattr(args, "vae_tile", None), getattr(args, "vae_overlap", None))
    from ..video_io import check_fps  # (light: numpy; torch loads with the first video)

    check_fps(args.fps)
    ParallelConfig(world=args.world, tp=args.tp, ulysses=args.ulysses, ring=args.ring,
                   cfg_parallel=args.cfg_parallel, vae_patch=args.vae_patch, devices="cpu",
                   memory_budget_gb=args.memory_budget_gb, worker_timeout=args.worker_timeout)


# -- model files -----------------------------------------------------------------------------------------------


@dataclass
class ModelFiles:
    """The files of a run (role -> path or None) and where each came from (role -> words for the plan line)."""

    paths: dict[str, str | None]
    sources: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        by_source: dict[str, list[str]] = {}
        for role, source in self.sources.items():
            by_source.setdefault(source, []).append(role.replace("_", " "))
        return "; ".join(f"{', '.join(roles)} from {source}" for source, roles in by_source.items())


def _tree_names(args) -> dict[str, str]:
    """The tiny set's file names (``TINY_FILES`` keys) a models tree gives for this command and its flags."""
    names = {"model": "vace" if wants_vace(args) and args.vace_module is None else "model", "vae": "vae",
             "text_encoder": "text_encoder"}
    if args.command == "generate" and wants_image(args):  # (streaming from an image runs the T2V model)
        # the tiny image-to-video models take the native-width text encoder and CLIP vision
        model = "fun_control" if getattr(args, "control_video", None) else "flf2v" if args.last_image else "i2v"
        names.update(model=model, text_encoder="text_encoder_native", clip_vision="clip_vision")
    return names


def resolve_model_files(args) -> ModelFiles:
    """Every model file of the run, composed from --models (or the tiny set) and the single-file flags."""
    given = {role: getattr(args, role, None) for role in ("model", "vae", "text_encoder", "clip_vision")}
    files = ModelFiles({"clip_vision": None, "vace_module": args.vace_module,
                        "model_low": getattr(args, "model_low", None)})
    for role, path in given.items():
        if path:
            files.paths[role], files.sources[role] = path, ROLE_FLAGS[role]
    for role in ("vace_module", "model_low"):
        if files.paths[role]:
            files.sources[role] = ROLE_FLAGS[role]
    if args.models is None and given["model"]:
        _complete_beside_model(files, args)
        return files
    if args.models is not None:
        root, source = args.models, f"--models {args.models}"
    else:
        root, source = ensure_tiny_models(tiny_cache_dir()), "the tiny built-in set"
    for role, name in _tree_names(args).items():
        if given.get(role):
            continue
        path = root / TINY_FILES[name]
        if not path.is_file():
            raise ValueError(f"{path} does not exist: --models expects a ComfyUI models tree as `wanmesh make-tiny "
                             f"DIR` writes; or give the file with {ROLE_FLAGS[role]}")
        files.paths[role], files.sources[role] = str(path), source
    return files


def _complete_beside_model(files: ModelFiles, args) -> None:
    """--model without --models: the VAE and text encoder that fit the model, from its ComfyUI folder layout
    (DIR/diffusion_models/MODEL beside DIR/vae, DIR/text_encoders), else (a small test model) from the tiny built-in
    set. A CLIP vision file is never guessed: an I2V model without --clip-vision is refused naming it."""
    needs = _model_needs(files.paths["model"])
    small = model_class(files.paths["model"])[1]
    model = Path(files.paths["model"])
    tree = model.parent.parent if model.parent.name in ("diffusion_models", "unet", "checkpoints") else None
    for role, fits in needs.items():
        if files.paths.get(role):
            continue
        found = _first_fitting(tree, FOLDERS[role], fits) if tree is not None else None
        source = f"beside --model ({tree})"
        if found is None and small:  # (a Wan release never gets the tiny set's random weights)
            found = _first_fitting(ensure_tiny_models(tiny_cache_dir()), FOLDERS[role], fits)
            source = "the tiny built-in set"
        if found is None:
            where = "beside it or in the tiny built-in set" if small else "beside it (a ComfyUI models tree)"
            raise ValueError(f"--model {model}: no {role.replace('_', ' ')} that fits it was found {where}; give it "
                             f"with {ROLE_FLAGS[role]}")
        files.paths[role], files.sources[role] = str(found), source


def _model_needs(model: str) -> dict:
    """role -> test of a candidate file: the VAE of the model's latent channels, the text encoder of its text
    width."""
    from ..validation import TRANSFORMER_KINDS, inspect_model_file, transformer_config, vae_latent_channels

    config = transformer_config(inspect_model_file(model, "--model", TRANSFORMER_KINDS)) or {}
    channels, text_dim = config.get("out_channels", 16), config.get("text_dim", 4096)

    def vae_fits(path: Path) -> bool:
        info = _info(path)
        return info is not None and info.kind == "wan_vae" and vae_latent_channels(info) == channels

    def text_fits(path: Path) -> bool:
        info = _info(path)
        return info is not None and info.kind == "umt5" and info.shapes.get("shared.weight", (0, 0))[-1] == text_dim

    return {"vae": vae_fits, "text_encoder": text_fits}


def _info(path: Path):
    from ..validation import inspect_model_file

    try:
        return inspect_model_file(path, "", ("wan_vae", "umt5", "diffusers_vae"))
    except ValueError:
        return None


def _first_fitting(root: Path, folders: tuple[str, ...], fits) -> Path | None:
    for folder in folders:
        if (root / folder).is_dir():
            for path in sorted((root / folder).iterdir()):
                if path.suffix.lower() == ".safetensors" and fits(path):
                    return path
    return None


# -- defaults by the model's class -------------------------------------------------------------------------------


def model_class(model: str) -> tuple[str, bool]:
    """(words for the plan line, whether it is a small test model) from the transformer's header or config."""
    from ..validation import TRANSFORMER_KINDS, inspect_model_file, transformer_config

    config = transformer_config(inspect_model_file(model, "--model", TRANSFORMER_KINDS)) or {}
    if "num_attention_heads" not in config:
        return "a Wan transformer folder", False
    dim = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    layers = int(config.get("num_layers", 0))
    small = dim < SMALL_MODEL_DIM
    return f"{'a small test model' if small else 'Wan'} (width {dim}, {layers} blocks)", small


def model_defaults(args, model: str, stream: bool = False) -> str:
    """Fill the size, frames, steps and shift not given from the model's class; words saying where each came from."""
    words, small = model_class(model)
    table = (TINY_STREAM_DEFAULTS if small else REAL_STREAM_DEFAULTS) if stream else \
        (TINY_DEFAULTS if small else REAL_DEFAULTS)
    filled = [key for key, value in table.items() if getattr(args, key) is None]
    for key in filled:
        setattr(args, key, table[key])
    user = [key for key in table if key not in filled]
    parts = ([f"{', '.join(filled)} from the model's class"] if filled else []) + \
        ([f"{', '.join(user)} from the user"] if user else [])
    args.model_class, args.small_model = words, small
    return "; ".join(parts)


# -- the plan line ----------------------------------------------------------------------------------------------


def plan_line(args, files: ModelFiles, config: ParallelConfig, defaults: str, command: str = "generate") -> str:
    """One line: model kind, size, frames, steps, sampler / scheduler, guidance, layout, devices, weights and where
    the defaults and files came from."""
    sampling = (f"{args.steps} steps, {args.sampler}/{args.scheduler}" if command == "generate"
                else f"{args.steps} steps per chunk of {args.chunk}")
    degrees = ", ".join(f"{name} {value}" for name, value in (("tp", config.tp), ("ulysses", config.ulysses),
                                                             ("ring", config.ring), ("vae_patch", config.vae_patch))
                        if value > 1) + (", cfg_parallel" if config.cfg_parallel else "")
    layout = f"world {config.world}" + (f" ({degrees})" if degrees else "") + f", layout {args.layout}"
    return (f"wanmesh {command}: {args.model_class}, {args.width}x{args.height}, {args.frames} frames, {sampling}, "
            f"cfg {args.guidance_scale:g}, shift {args.shift:g}, seed {args.seed}; {layout}; devices "
            f"{devices_words(config)}; weights {weights_words(args, files.paths['model'])}; defaults: {defaults}; "
            f"{files.describe()}")


def devices_words(config: ParallelConfig) -> str:
    import torch

    devices = ",".join(config.devices)
    if devices == "auto":
        devices = f"cuda (x{torch.cuda.device_count()})" if torch.cuda.is_available() else "cpu"
    if devices.startswith("cpu"):
        devices += f" ({os.cpu_count()} cores)"
    return devices


def runs_on_cpu(config: ParallelConfig) -> bool:
    import torch

    return all(d.startswith("cpu") for d in config.devices) or (config.devices == ("auto",)
                                                                  and not torch.cuda.is_available())


def weights_words(args, model: str) -> str:
    """The file's stored type and what the ranks hold: `GGUF Q8_0, kept quantized, compute fp32`."""
    from ..validation import TRANSFORMER_KINDS, inspect_model_file

    info = inspect_model_file(model, "--model", TRANSFORMER_KINDS)
    stored = stored_type_by_elements(info.dtypes, info.shapes)
    quantized = stored.startswith("F8") or (Path(model).suffix.lower() == ".gguf")
    held = ("kept quantized" if args.weights == "keep" else "dequantized at load") if quantized else "as stored"
    return f"{stored} file, {held}, compute dtype {args.dtype}"


def stored_type_by_elements(dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> str:
    """The stored type holding most of a file's weights (by element count, not tensor count: a scaled-fp8 file has
    more bf16 norms and scales than fp8 matrices, yet nearly all its bytes are fp8); "as in the folder" when the
    header names no types (diffusers folders)."""
    elements: dict[str, int] = {}
    for name, dtype in dtypes.items():
        elements[str(dtype)] = elements.get(str(dtype), 0) + math.prod(shapes.get(name, ()))
    return max(elements, key=elements.get) if elements else "as in the folder"


def step_estimate(args, model: str, config: ParallelConfig) -> str | None:
    """On a CPU, for a Wan release's size: the cost model's time of one step at this CPU's measured matmul
    speed (a second of measuring) and a hint for a quick try."""
    if getattr(args, "small_model", True) or not runs_on_cpu(config):
        return None
    from ..auto_layout import Job, Layout, Link, Machine, ModelCost, predict

    try:
        cost = ModelCost.from_file(model)
    except ValueError:
        return None
    flops = _cpu_matmul_flops()
    free = Link(0.0, float("inf"))
    machine = Machine(matmul_flops=flops, attention_flops=flops, all_reduce=free, all_to_all=free, send_recv=free,
                      free_bytes=1 << 62)
    job = Job(args.width, args.height, args.frames, steps=args.steps, guidance=args.guidance_scale != 1.0)
    step_s = predict(Layout(), 1, cost, job, machine).step_s
    return (f"wanmesh: estimate: about {_duration(step_s)} per step on this CPU ({_duration(step_s * args.steps)} "
            f"for {args.steps} steps at {args.width}x{args.height}, {args.frames} frames); for a quick try pass a "
            f"smaller size, e.g. {QUICK_TRY}")


def _cpu_matmul_flops() -> float:
    import time

    import torch

    a = torch.randn(768, 768)
    torch.mm(a, a)
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < 0.3:
        torch.mm(a, a)
        count += 1
    return count * 2 * 768 ** 3 / (time.perf_counter() - started)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- output space ------------------------------------------------------------------------------------------------


MP4_BYTES_PER_PIXEL = 0.5  # H.264 at crf 19 stays well under this on generated video (noise included)
HEADER_BYTES = 4096


def check_output_space(outputs: list[tuple[str, Path | None, int]]) -> None:
    """(flag, path, expected bytes) of each output: the outputs on one file system need no more than it has free
    (checked before sampling, so a full disk is found before the work)."""
    need: dict[int, list] = {}
    for flag, path, size in outputs:
        if path is None:
            continue
        folder = Path(path).parent
        try:
            device = folder.stat().st_dev
        except OSError:
            continue  # created later (check_output_path made it); a folder that cannot be read fails there
        entry = need.setdefault(device, [folder, 0, []])
        entry[1] += size + HEADER_BYTES
        entry[2].append(f"{flag} {path}")
    for folder, size, names in need.values():
        free = shutil.disk_usage(folder).free
        if free < size:
            raise ValueError(f"{' and '.join(names)} need about {_megabytes(size)} but {folder} has "
                             f"{_megabytes(free)} free; free some space or write to another disk")


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def generate_output_sizes(args, latent_elements: int) -> list[tuple[str, Path | None, int]]:
    """The expected size of each output of `generate`: the latents and frames exactly (float32), the MP4 roughly."""
    pixels = args.width * args.height * args.frames
    return [("--out", args.out, int(pixels * MP4_BYTES_PER_PIXEL)),
            ("--save-latents", args.save_latents, 4 * latent_elements),
            ("--save-frames", args.save_frames, 4 * 3 * pixels)]
