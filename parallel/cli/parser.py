"""The `wanmesh` command's argument parser, in the CLI process; imports nothing heavy (no torch, no model
library), so that `wanmesh --help` and every refusal of a bad flag or value come back at once. Each benchmark's
own flags load only for the benchmark named on the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..fields import BY_KEY, add_flag
from .layout import add_layout_arguments

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
    files = parser.add_argument_group(
        "models (they compose: --models DIR gives every file, a single-file flag replaces one of them; --model "
        "alone takes the VAE and text encoder of its kind beside it or from the tiny built-in set)")
    files.add_argument("--models", type=Path, help="a ComfyUI models tree (diffusion_models/, vae/, text_encoders/, "
                       "clip_vision/), e.g. written by `wanmesh make-tiny`; default: the tiny built-in models")
    files.add_argument("--model", help=model_help)
    add_flag(files, "weights", command)
    files.add_argument("--vae", help="Wan VAE file or folder (replaces the one --models or --model implies)")
    files.add_argument("--text-encoder", help="umT5 text encoder file or folder (replaces the one --models or --model "
                       "implies)")
    return files


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--quiet: no plan line, phases or progress (errors and warnings still go to stderr)."""
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="print no plan, phases or progress; only the result line, warnings and errors")


POOL_FIELDS = ("world", "tp", "ulysses", "ring", "cfg_parallel", "vae_patch", "worker_timeout", "memory_budget_gb",
               "backend", "ray_address")


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
    for key in ("dtype", "fps", "timings", "cache"):
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
    add_output_arguments(p)


def build_parser(bench_options: bool | str = True) -> argparse.ArgumentParser:
    """The command's parser. ``bench_options``: True adds every benchmark's own flags, a benchmark's name only
    its flags, False none (their modules import the model libraries, seconds each)."""
    import sys

    parser = argparse.ArgumentParser(prog="wanmesh", description=sys.modules[__package__].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print tracebacks with errors")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write the tiny test models as a ComfyUI models tree")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--preset", choices=["tiny", "medium"], default="tiny",
                      help="tiny: every test model (default); medium: a ~150M-parameter T2V transformer as bf16, "
                           "scaled fp8, Q8_0 and Q4_K GGUF, with the tiny VAE and text encoder")
    tiny.add_argument("--native-vae22", action="store_true",
                      help="also write vae/wan22_native_vae.safetensors: a random Wan 2.2 VAE at the release widths "
                           "(1.4 GB), the smallest one ComfyUI's own VAELoader loads (it builds every Wan 2.2 VAE at "
                           "those widths)")
    add_output_arguments(tiny)
    _add_generate(sub)
    add_stream_arguments(sub)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write a plot)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        bench_parser = bench_sub.add_parser(name, help=help_text)
        if bench_options is True or bench_options == name:
            _bench_module(module).add_arguments(bench_parser)
        if not any(action.dest == "quiet" for action in bench_parser._actions):
            add_output_arguments(bench_parser)
    return parser


def bench_named(argv: list[str]) -> str | bool:
    """The benchmark an argument list names (``wanmesh bench NAME ...``), for ``build_parser``; False when none."""
    if "bench" not in argv:
        return False
    rest = argv[argv.index("bench") + 1:]
    return next((word for word in rest if word in BENCHMARKS), False)


BENCHMARKS = {
    "dit": ("dit", "one denoise step: WanMesh against diffusers' transformer"),
    "pool": ("pool", "worker pool: empty round trip, moving a video to the workers and back, pool start "
                     "forked from the worker template against importing"),
    "tp": ("tp", "tensor parallelism: bytes per collective, time per step, weight memory"),
    "vae": ("vae", "VAE patch parallelism: decode time and peak memory per rank"),
    "attention": ("attention", "ring attention with and without overlap against all-gather attention"),
    "lora": ("lora", "LoRA merge on the workers: load, switch and remove times per tp degree"),
    "stream": ("stream", "causal streaming: first-chunk latency, time per chunk, frames/s, cache memory per rank"),
    "native-model": ("native", "ComfyUI's KSampler on the WanMesh MODEL against the WanMesh Sampler: step time"),
    "i2v": ("i2v", "image-to-video against text-to-video: one guided step of each model kind at the same size"),
    "plan": ("plan", "auto layout: predicted against measured step time of every layout, Spearman, the choice; "
                     "with --hardware NAME, every layout predicted on a GPU cluster from its datasheet"),
    "long-stream": ("long_stream", "a stream of many times the trained length: memory per chunk and the step at "
                                   "the window's edge, whole cache against a rolling window and a re-anchored one"),
    "cache": ("cache", "step caching (TeaCache, MagCache, first-block cache) against no cache: wall time, calls, "
                       "latents' distance, per layout"),
    "real-size": ("real_size", "released Wan models at their real sizes, written on the fly: load time, memory per "
                               "rank against its share of the file, one step, per layout"),
    "memory": ("memory", "quantized weights kept or dequantized: resident, file and load-peak bytes and step time per rank"),
    "soak": ("soak", "many prompts against a running ComfyUI server: server and worker memory, fds, shared memory"),
    "gpu": ("gpu_check", "the CUDA path proven and measured on one GPU (tests/gpu/run.sh); --dry-run on the CPU"),
    "cli-start": ("cli_start", "command-line start-up: `wanmesh --help` and refusals of bad flags and values, median "
                  "and spread over fresh interpreters"),
    "families": ("families", "Fun Control, Fun Camera and Animate against T2V at the same size: step time and "
                             "counted FLOPs, their ratios"),
}


def _bench_module(name: str):
    import importlib

    return importlib.import_module(f"{__package__.rpartition('.')[0]}.bench.{name}")


def add_stream_arguments(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("stream", help="causal streaming text to video: chunks written as they are made")
    add_model_file_arguments(p, "causal Wan 2.1 transformer (Self-Forcing, CausVid, ...): file or folder", "stream")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative", default="", help="negative prompt (used only with --cfg above 1)")
    p.add_argument("--prompt-at", action="append", default=[], metavar="CHUNK:PROMPT", dest="prompt_at",
                   help="switch to PROMPT before chunk CHUNK (repeat for several switches; chunk 0 is --prompt's): the "
                   "cached frames are re-encoded under the new prompt, so the scene moves on without a cut")
    p.add_argument("--live-prompts", action="store_true", dest="live_prompts",
                   help="read prompts from standard input while streaming, one per line: each switches the stream at "
                   "the next chunk (as --prompt-at there), and the chunk is printed")
    for key in ("width", "height", "length", "chunk", "stream_steps", "stream_shift", "timesteps"):
        add_flag(p, key, "stream")
    add_flag(p, "stream_cfg", "stream", "--cfg", dest="guidance_scale")
    add_flag(p, "kv_window", "stream")
    add_flag(p, "sink", "stream")
    add_flag(p, "reanchor", "stream")
    add_flag(p, "cache", "stream")
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
    add_flag(p, "timings", "stream")
    p.add_argument("--out", type=Path, required=True, help="the MP4 file of the whole video")
    p.add_argument("--chunk-dir", type=Path, required=True, help="folder for chunk_000.mp4, chunk_001.mp4, ...")
    p.add_argument("--save-latents", type=Path, help="write the raw latents [B,16,T,h,w] as tensor 'latents'")
    add_output_arguments(p)
    return p


# The flags that ask for a VACE context (dest name -> flag), in the order errors name them.
VACE_FLAGS = {"vace_video": "--vace-video", "vace_mask": "--vace-mask", "vace_ref": "--vace-ref",
              "vace_control": "--vace-control", "vace_strength": "--vace-strength", "outpaint": "--outpaint",
              "extend_keep": "--extend-keep", "save_vace": "--save-vace"}
NEEDS_VIDEO = ("vace_control", "outpaint", "extend_keep")
SETS_MASK = ("vace_mask", "outpaint", "extend_keep")


def add_vace_arguments(parser) -> None:
    """The VACE flags of `wanmesh generate`."""
    vace = parser.add_argument_group("VACE (any of these uses the tiny VACE model when --model is not given)")
    vace.add_argument("--vace-video", type=Path, help="video to edit or follow: an MP4, an image or a folder of "
                      "frames (0..1 colours); --width/--height/--frames default to its size and frame count")
    vace.add_argument("--vace-mask", type=Path, help="what to generate (white) and keep (black): an MP4, an image "
                      "(one mask for every frame) or a folder; luminance 0..1")
    vace.add_argument("--vace-ref", type=Path, action="append", help="reference image (repeatable)")
    add_flag(vace, "vace_control", "generate")
    add_flag(vace, "vace_strength", "generate")
    vace.add_argument("--outpaint", metavar="L,T,R,B", help="pixels added on each side of --vace-video "
                      "(the padded size must be multiples of 16 and becomes the default --width/--height)")
    vace.add_argument("--extend-keep", metavar="FIRST,LAST", help="keep the first FIRST and last LAST frames "
                      "of --vace-video and generate the frames between (--frames in all)")
    vace.add_argument("--save-vace", type=Path, help="write the VACE context as tensors 'vace_frames' "
                      "[1,32,R+T,h,w] and 'vace_mask' [1,64,R+T,h,w] (ComfyUI's raw format)")


def wants_vace(args) -> bool:
    return any(getattr(args, name, None) is not None for name in VACE_FLAGS)


IMAGE_FLAGS = {"image": "--image", "last_image": "--last-image", "clip_vision": "--clip-vision",
               "control_video": "--control-video"}
# parallel/camera_motion.py's CAMERA_MOTIONS (kept here too: the parser loads no torch)
CAMERA_MOTION_NAMES = ("static", "pan-up", "pan-down", "pan-left", "pan-right", "zoom-in", "zoom-out",
                       "anti-clockwise", "clockwise")
MAX_CAMERA_SPEED = 10.0


def add_image_arguments(parser) -> None:
    group = parser.add_argument_group("image to video (the model's kind decides what it needs)")
    group.add_argument("--image", help="the start image (image-to-video and first-last-frame models)")
    group.add_argument("--last-image", help="the end image (first-last-frame models)")
    group.add_argument("--clip-vision", help="CLIP vision file, e.g. clip_vision_h.safetensors (Wan 2.1 I2V / FLF2V)")
    group.add_argument("--control-video", help="the control video (Fun Control models: an MP4 or other video, an "
                                               "image or a folder of frames); with Wan 2.2 Fun Control, --image is "
                                               "the reference image")
    group.add_argument("--camera-motion", choices=CAMERA_MOTION_NAMES,
                       help="a preset camera motion (Wan 2.1 and 2.2 Fun Camera models), as ComfyUI's WanCameraEmbedding "
                            "camera_pose")
    group.add_argument("--camera-speed", type=float, default=1.0,
                       help="how far the camera motion goes over the video (WanCameraEmbedding's speed, 0 to 10)")


def wants_image(args) -> bool:
    return any(getattr(args, name, None) is not None for name in ("image", "last_image", "control_video"))


