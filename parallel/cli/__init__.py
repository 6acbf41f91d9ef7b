"""The `wanmesh` command line: make-tiny, generate, stream and bench; runs in the CLI (driver) process.

It drives the same worker pool and runner the ComfyUI nodes use. Subcommands import what they need when run,
so `wanmesh --help` stays quick.

Exit codes: 0 done, 2 bad input (one line on stderr, found before any worker starts where the check is static),
1 a runtime failure (a worker error, an OS error such as a full disk: one line), 130 interrupted (Ctrl-C).
`--debug` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from ..fields import BY_KEY, add_flag
from ..tiny.files import TINY_FILES, ensure_tiny_models, tiny_cache_dir
from .layout import add_layout_arguments, check_layout_arguments
from .image_inputs import ImageInputs, add_image_arguments, wants_image
from .vace_inputs import add_vace_arguments, read_vace_inputs, wants_vace

# Sizes used when nothing is given: the real Wan 480p default (the fields' defaults, as the nodes have them), or a
# quick clip for the tiny built-in models.
REAL_DEFAULTS = {flag: BY_KEY[key].default for flag, key in
                 (("width", "width"), ("height", "height"), ("frames", "length"), ("steps", "steps"), ("shift", "shift"))}
TINY_DEFAULTS = {"width": 128, "height": 96, "frames": 17, "steps": 10, "shift": 3.0}
TINY_STREAM_DEFAULTS = {"width": 128, "height": 96, "frames": 17}  # `wanmesh stream`: 5 latent frames, chunks 3+2
REAL_STREAM_DEFAULTS = {key: REAL_DEFAULTS[key] for key in ("width", "height", "frames")}


def add_model_file_arguments(parser: argparse.ArgumentParser, model_help: str, command: str):
    """--models / --model / --weights / --vae / --text-encoder, shared by the commands that generate; returns the
    group."""
    files = parser.add_argument_group("models (default: the tiny built-in models in a cache folder)")
    files.add_argument("--models", type=Path, help="a models tree written by `wanmesh make-tiny`")
    files.add_argument("--model", help=model_help)
    add_flag(files, "weights", command)
    files.add_argument("--vae", help="Wan 2.1 VAE file or folder")
    files.add_argument("--text-encoder", help="umT5 text encoder file or folder")
    return files


POOL_FIELDS = ("world", "tp", "ulysses", "ring", "cfg_parallel", "vae_patch", "worker_timeout", "memory_budget_gb")


def add_pool_arguments(parser: argparse.ArgumentParser, command: str):
    """The worker pool's flags (what `cli.generate.pool_config` reads), shared by the commands that generate;
    returns the group. A command without a field's flag (`stream` refuses ring and CFG parallel and does not use
    VAE patches) gets its single-device value."""
    pool = parser.add_argument_group("parallelism")
    add_layout_arguments(pool, command)
    for key in POOL_FIELDS:
        if any(entry.startswith(f"{command} ") for entry in BY_KEY[key].flags):
            add_flag(pool, key, command)
        else:
            pool.set_defaults(**{key: BY_KEY[key].default})
    return pool


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="text to video (tiny built-in models when no model is given)")
    files = add_model_file_arguments(
        p, "Wan T2V or VACE transformer (.safetensors or .gguf single file, or diffusers folder)", "generate")
    files.add_argument("--vace-module", help="VACE module file merged onto --model")
    files.add_argument("--model-low", help="Wan 2.2 A14B: the low-noise expert (--model is then the high-noise one)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative", default="")
    for key in ("width", "height", "length", "steps"):
        add_flag(p, key, "generate")
    add_flag(p, "cfg", "generate", "--cfg", dest="guidance_scale")
    for key in ("shift", "seed", "sampler", "scheduler"):
        add_flag(p, key, "generate")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    experts = p.add_argument_group("two experts (Wan 2.2 A14B) and step ranges")
    add_flag(experts, "boundary", "generate")
    add_flag(experts, "cfg_low_noise", "generate", dest="guidance_scale_low")
    add_flag(experts, "start_step", "generate")
    add_flag(experts, "end_step", "generate")
    par = add_pool_arguments(p, "generate")
    add_flag(par, "tile_px", "generate")
    add_flag(par, "overlap_px", "generate")
    for key in ("dtype", "fps", "timings"):
        add_flag(p, key, "generate")
    p.add_argument("--out", type=Path, required=True, help="the MP4 file to write")
    p.add_argument("--save-latents", type=Path,
                   help="write the raw latents [B,16,T,h,w] (VACE reference frames trimmed) as tensor 'latents'")
    p.add_argument("--save-frames", type=Path, help="write the frames [F,H,W,3] 0..1 as tensor 'frames'")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="LoRA merged into the model on the workers (repeatable, applied in order; strength 1.0 when "
                        "not given, -100..100 as ComfyUI's LoRA loader)")
    add_vace_arguments(p)
    add_image_arguments(p)


def build_parser(bench_options: bool = True) -> argparse.ArgumentParser:
    """The command's parser; ``bench_options=False`` leaves out the benchmarks' own flags, whose modules import
    the model libraries (seconds), so that `generate` checks its input and fails fast."""
    parser = argparse.ArgumentParser(prog="wanmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print tracebacks with errors")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write the tiny test models as a ComfyUI models tree")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--preset", choices=["tiny", "medium"], default="tiny",
                      help="tiny: every test model (default); medium: a ~150M-parameter T2V transformer as bf16, "
                           "scaled fp8, Q8_0 and Q4_K GGUF, with the tiny VAE and text encoder")
    _add_generate(sub)
    _stream_cli().add_arguments(sub)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write a plot)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        bench_parser = bench_sub.add_parser(name, help=help_text)
        if bench_options:
            _bench_module(module).add_arguments(bench_parser)
    return parser


BENCHMARKS = {
    "dit": ("dit", "one denoise step: WanMesh against diffusers' transformer"),
    "pool": ("pool", "worker pool: empty round trip, moving a video to the workers and back"),
    "tp": ("tp", "tensor parallelism: bytes per collective, time per step, weight memory"),
    "vae": ("vae", "VAE patch parallelism: decode time and peak memory per rank"),
    "attention": ("attention", "ring attention with and without overlap against all-gather attention"),
    "lora": ("lora", "LoRA merge on the workers: load, switch and remove times per tp degree"),
    "stream": ("stream", "causal streaming: first-chunk latency, time per chunk, frames/s, cache memory per rank"),
    "native-model": ("native", "ComfyUI's KSampler on the WanMesh MODEL against the WanMesh Sampler: step time"),
    "i2v": ("i2v", "image-to-video against text-to-video: one guided step of each model kind at the same size"),
    "plan": ("plan", "auto layout: predicted against measured step time of every layout, Spearman, the choice"),
    "memory": ("memory", "quantized weights kept or dequantized: resident, file and load-peak bytes and step time per rank"),
    "gpu": ("gpu_check", "the CUDA path proven and measured on one GPU (tests/gpu/run.sh); --dry-run on the CPU"),
    "soak": ("soak", "many prompts against a running ComfyUI server: server and worker memory, fds, shared memory"),
}


def _stream_cli():
    from . import stream

    return stream


def _bench_module(name: str):
    import importlib

    return importlib.import_module(f"{__package__.rpartition('.')[0]}.bench.{name}")


def resolve_model_files(args) -> dict[str, str | None]:
    """The four model paths from --models, the single-file flags, or the tiny built-in models (the tiny VACE
    model when a VACE flag is given without --vace-module)."""
    single = {"model": args.model, "vae": args.vae, "text_encoder": args.text_encoder}
    if args.models is not None and any(single.values()):
        raise ValueError("give either --models DIR or --model/--vae/--text-encoder, not both")
    if any(single.values()):
        missing = [f"--{k.replace('_', '-')}" for k, v in single.items() if not v]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}: --model, --vae and --text-encoder go together")
        return {**single, "vace_module": args.vace_module, "model_low": getattr(args, "model_low", None),
                "clip_vision": getattr(args, "clip_vision", None)}
    root = args.models if args.models is not None else ensure_tiny_models(tiny_cache_dir())
    names = {"model": "vace" if wants_vace(args) and args.vace_module is None else "model", "vae": "vae",
             "text_encoder": "text_encoder"}
    if args.command == "generate" and wants_image(args):  # (streaming from an image runs the T2V model)
        # the tiny image-to-video models take the native-width text encoder and CLIP vision
        names.update(model="flf2v" if args.last_image else "i2v", text_encoder="text_encoder_native",
                     clip_vision="clip_vision")
    paths = {key: str(root / TINY_FILES[name]) for key, name in names.items()}
    for key, path in paths.items():
        if not Path(path).is_file():
            raise ValueError(f"{path} does not exist: --models expects a tree written by `wanmesh make-tiny DIR`")
    if getattr(args, "clip_vision", None):
        paths["clip_vision"] = args.clip_vision
    return {"clip_vision": None, **paths, "vace_module": args.vace_module, "model_low": getattr(args, "model_low", None)}


def read_loras(lora_args: list[str], files: dict) -> list[tuple[str, float]]:
    """--lora FILE[:STRENGTH] values as (file, strength), each file's header checked against the model's."""
    from ..validation import check_lora_values
    from ..weights.lora_files import check_lora_for_model, parse_lora_arg

    loras = [parse_lora_arg(text) for text in lora_args]
    model_files = [path for path in (files["model"], files["vace_module"]) if path]
    for path, _ in loras:
        check_lora_for_model(path, model_files)
        check_lora_values(path, "--lora")
    return loras


def apply_defaults(args, tiny: bool) -> None:
    for key, value in (TINY_DEFAULTS if tiny else REAL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(bench_options="bench" in argv).parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return _fail(args, EXIT_INTERRUPTED, "interrupted")
    except ValueError as error:  # bad input (checks in config.py / validation.py): one line
        return _fail(args, EXIT_BAD_INPUT, str(error))
    except Exception as error:  # noqa: BLE001 - worker errors, OS errors: one line, traceback with --debug
        return _fail(args, EXIT_FAILED, one_line(error))


def one_line(error: BaseException) -> str:
    """The cause in one line: a worker error's rank, type and message (its traceback stays out), an OS error's
    text with the file it concerns."""
    from ..errors import WorkerError

    if isinstance(error, WorkerError):
        where = f"rank {error.rank}" if error.rank is not None else "worker pool"
        return f"{where}: {error.error_type}: {error.message.strip().splitlines()[0] if error.message else ''}"
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{type(error).__name__}: {error.strerror}{where}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _fail(args, code: int, message: str) -> int:
    generate_module = sys.modules.get(f"{__name__}.generate")
    if generate_module is not None:
        generate_module.end_progress_line()
    if getattr(args, "debug", False):
        traceback.print_exc()
    print(f"wanmesh: error: {message}" if code != EXIT_INTERRUPTED else message, file=sys.stderr, flush=True)
    return code


def _run(args) -> int:
    if args.command in ("generate", "stream"):
        check_layout_arguments(args)
    if args.command == "make-tiny":
        from ..tiny.models import make_models

        for name, path in make_models(args.directory, args.preset).items():
            print(f"{name:>14}: {path}")
        return 0
    if args.command == "generate":
        from .generate import generate

        files = resolve_model_files(args)
        files["loras"] = read_loras(args.lora, files)  # headers checked against the model before the pool starts
        vace = read_vace_inputs(args, files)  # VACE files read and checked; sizes default to the video's
        apply_defaults(args, tiny=args.model is None)
        image = ImageInputs.read(args, files)  # the model's kind against the images given, images read
        generate(args, files, vace, image)
        return 0
    if args.command == "stream":
        for key, value in (TINY_STREAM_DEFAULTS if args.model is None else REAL_STREAM_DEFAULTS).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        _stream_cli().check_stream_arguments(args)  # every option, before model files are made or read
        _stream_cli().stream(args, resolve_model_files(args))
        return 0
    if args.command == "bench":
        status = _bench_module(BENCHMARKS[args.bench][0]).run(args)
        return status if isinstance(status, int) else 0  # some benchmarks return their rows
    return 2


if __name__ == "__main__":
    sys.exit(main())
