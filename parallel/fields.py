"""The table of every user-facing setting: one row per field, read by the nodes, the command line and the tests.

A field says once what a setting is called, its type, default, the range its widget offers, the values the
checks accept (``valid``), its help text, and where users meet it: node inputs (``"WanMeshSampler.steps"``),
command-line flags (``"generate --steps"``) and the request or config attribute the protocol checks
(``"SampleRequest.steps"``). The nodes build their inputs with :func:`node_input`, the command line its flags
with :func:`add_flag`; the settings table of ``docs/settings.md`` is :func:`markdown_table` (``python -m
wanmesh.parallel.fields docs/settings.md`` rewrites it). tests/unit/test_fields.py fails when a node input, a flag, a
protocol check or that page disagrees with a row. Plain Python, light at import; used in the driver process
(ComfyUI or CLI).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .config import (BACKENDS, CONTROL_MODES, LAYOUT_MODES, DEFAULT_WORKER_TIMEOUT_S, DTYPE_NAMES, I2V_EXPERT_BOUNDARY, LORA_STRENGTH_RANGE,
                     MAX_SEED, MIN_WORKER_TIMEOUT_S, SAMPLERS, SCHEDULERS, T2V_EXPERT_BOUNDARY, DEFAULT_SAMPLER,
                     DEFAULT_SCHEDULER, WEIGHT_MODES)

END_STEP_TO_THE_END = 10000  # ComfyUI's advanced sampler default for "run to the last step"
MAX_DEGREE = 64
MAX_SIZE = 8192
MAX_FRAMES = 1025
MAX_CACHE_FRAMES = 1 << 20


@dataclass(frozen=True)
class Valid:
    """The values the checks accept: low..high, each end open or closed (None: unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def text(self) -> str:
        low = "" if self.low is None else ("> " if self.low_open else ">= ") + _number(self.low)
        high = "" if self.high is None else ("< " if self.high_open else "<= ") + _number(self.high)
        return ", ".join(part for part in (low, high) if part) or "any"


@dataclass(frozen=True)
class Field:
    """One user-facing setting. ``kind``: INT, FLOAT, BOOLEAN, STRING or CHOICE (one of ``choices``).
    ``low``/``high``/``step``: the node widget's range; ``valid``: what the protocol checks accept.
    ``checked``: the protocol attributes (``Class.attribute``) or check functions (``module.function``) that
    enforce ``valid``. ``flag_default``: the command line's default where it differs (None: chosen from the models,
    e.g. the tiny models' smaller sizes); ``note``: what the table says beyond ``help``."""

    key: str
    kind: str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()
    valid: Valid | None = None
    nodes: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    flag_default: Any = ...
    note: str = ""
    unset: Any = ...  # the node value a request holds as None ("the whole video", "to the end"); ...: none

    @property
    def cli_default(self) -> Any:
        return self.default if self.flag_default is ... else self.flag_default


def _degree(key: str, help_text: str, flags: tuple[str, ...]) -> Field:
    return Field(key, "INT", 1, help_text, 1, MAX_DEGREE, valid=Valid(1), nodes=(f"WanMeshPool.{key}",),
                 flags=flags, checked=(f"ParallelConfig.{key}",))


FIELDS: tuple[Field, ...] = (
    # -- the worker pool
    Field("devices", "STRING", "auto", "auto, cpu:N (N CPU ranks: N must be the world), or a list such as "
          "cuda:0,1,2,3 (the machine's GPU numbers, as nvidia-smi lists them)", nodes=("WanMeshPool.devices",),
          checked=("ParallelConfig.devices",), note="CLI: --device cpu|cuda"),
    _degree("world", "worker processes (ranks) in the pool; one per GPU", ("generate --world", "stream --world")),
    _degree("tp", "tensor-parallel degree: splits the attention heads (and a stream's KV cache); must divide the "
            "head count", ("generate --tp", "stream --tp")),
    _degree("ulysses", "Ulysses sequence-parallel degree (one all-to-all per attention); tp x ulysses must divide "
            "the head count", ("generate --ulysses", "stream --ulysses")),
    _degree("ring", "ring-attention sequence-parallel degree (not with streaming)", ("generate --ring",)),
    Field("cfg_parallel", "BOOLEAN", False, "run the conditional and unconditional passes on two halves of the "
          "pool (not with streaming)", nodes=("WanMeshPool.cfg_parallel",), flags=("generate --cfg-parallel",),
          checked=("ParallelConfig.cfg_parallel",)),
    _degree("vae_patch", "ranks that share the VAE tiles", ("generate --vae-patch",)),
    Field("backend", "CHOICE", BACKENDS[0], "local: processes on this machine; ray: actors on a Ray cluster",
          choices=BACKENDS, nodes=("WanMeshPool.backend",), flags=("generate --backend", "stream --backend"),
          checked=("ParallelConfig.backend",)),
    Field("ray_address", "STRING", "", "Ray cluster address (ray backend; empty: auto)",
          nodes=("WanMeshPool.ray_address",), flags=("generate --ray-address", "stream --ray-address")),
    Field("worker_timeout", "FLOAT", DEFAULT_WORKER_TIMEOUT_S, "seconds a worker may stop answering (or wait in a "
          "collective) before the pool names it, stops and restarts on next use; raise it for very slow models",
          MIN_WORKER_TIMEOUT_S, 86400.0, 1.0, valid=Valid(MIN_WORKER_TIMEOUT_S), nodes=("WanMeshPool.worker_timeout",),
          flags=("generate --worker-timeout", "stream --worker-timeout"), checked=("ParallelConfig.worker_timeout",)),
    Field("previews", "BOOLEAN", True, "show a small preview of the video being made at every sampler step "
          "(cheap, no VAE); off sends no preview images", nodes=("WanMeshPool.previews",)),
    Field("memory_budget_gb", "FLOAT", 0.0, "GB of model weights each rank keeps resident; loading past it unloads "
          "the least recently used models, and a transformer larger than it alone streams its blocks from host "
          "memory. 0 = auto (what the device can hold)", 0.0, 4096.0, 0.5, valid=Valid(0.0),
          nodes=("WanMeshPool.memory_budget_gb",), flags=("generate --memory-budget-gb", "stream --memory-budget-gb"),
          checked=("ParallelConfig.memory_budget_gb",)),
    Field("layout", "CHOICE", "manual", "manual: the degrees given; auto: the degrees that fit in memory and "
          "minimise the predicted job time, from a cost model calibrated on this machine (the chosen layout and "
          "the next two are logged with their predicted step time and memory); auto leaves tp, ulysses, ring, "
          "cfg_parallel and vae_patch at 1 and chooses them for each job when its size is known",
          choices=LAYOUT_MODES, nodes=("WanMeshPool.layout",), flags=("generate --layout", "stream --layout")),
    Field("reprobe", "BOOLEAN", False, "with --layout auto: calibrate the machine again instead of reading the "
          "cached figures", flags=("generate --reprobe", "stream --reprobe")),
    Field("timings", "STRING", "", "write the run's time breakdown here as JSON: pool start, text encode, weight "
          "load, VAE encode and decode, sampling, writing, and per rank and step the compute and communication "
          "seconds; for stream the phases and each chunk's latency", flags=("generate --timings", "stream --timings"),
          flag_default=None,
          note="the WanMesh Sampler logs the same figures' summary after each run"),
    # -- loading models
    Field("dtype", "CHOICE", DTYPE_NAMES[0], "compute dtype; auto: bf16 on GPUs, fp32 on the CPU", choices=DTYPE_NAMES,
          nodes=("WanMeshModelLoader.dtype", "WanMeshVAELoader.dtype", "WanMeshTextEncoderLoader.dtype"),
          flags=("generate --dtype", "stream --dtype")),
    Field("weights", "CHOICE", WEIGHT_MODES[0], "keep: quantized weights (fp8, scaled fp8, GGUF) stay quantized on "
          "every rank and are dequantized per layer for its matmul; dequantize: expanded to the compute dtype at "
          "load, faster steps, more memory", choices=WEIGHT_MODES, nodes=("WanMeshModelLoader.weights",),
          flags=("generate --weights", "stream --weights"), checked=("LoadModel.weights",)),
    Field("lora_strength", "FLOAT", 1.0, "how strongly the LoRA changes the model; 0 leaves it unchanged, negative "
          "values invert it (native LoraLoaderModelOnly's range)", *LORA_STRENGTH_RANGE, 0.01,
          valid=Valid(*LORA_STRENGTH_RANGE), nodes=("WanMeshLoraLoader.strength",),
          checked=("config.check_lora_strength",), note="CLI: --lora FILE:STRENGTH"),
    # -- the video
    Field("width", "INT", 832, "video width in pixels; any multiple of 8 (the widget steps by 16, as native's)", 16,
          MAX_SIZE, 16, nodes=("WanMeshEmptyLatent.width", "WanMeshImageToVideo.width", "WanMeshWan22ImageToVideoLatent.width"), flags=("generate --width", "stream --width"),
          flag_default=None, note="CLI default: the video's (VACE), 128 for the tiny models"),
    Field("height", "INT", 480, "video height in pixels; any multiple of 8 (the widget steps by 16, as native's)", 16,
          MAX_SIZE, 16, nodes=("WanMeshEmptyLatent.height", "WanMeshImageToVideo.height", "WanMeshWan22ImageToVideoLatent.height"), flags=("generate --height", "stream --height"),
          flag_default=None, note="CLI default: the video's (VACE), 96 for the tiny models"),
    Field("vace_width", "INT", 832, "video width in pixels (multiple of 16)", 16, MAX_SIZE, 16,
          nodes=("WanMeshVaceEncode.width",), checked=("EncodeVace.width",), note="CLI: --width"),
    Field("vace_height", "INT", 480, "video height in pixels (multiple of 16)", 16, MAX_SIZE, 16,
          nodes=("WanMeshVaceEncode.height",), checked=("EncodeVace.height",), note="CLI: --height"),
    Field("vace_strength", "FLOAT", 1.0, "how strongly this VACE context steers the video; 0 ignores it", 0.0, 1000.0,
          0.01, nodes=("WanMeshVaceEncode.strength",), flags=("generate --vace-strength",), flag_default=None,
          note="CLI default: 1"),
    Field("length", "INT", 81, "frames, 4k+1", 1, MAX_FRAMES, 4, nodes=("WanMeshEmptyLatent.length",
          "WanMeshVaceEncode.length", "WanMeshImageToVideo.length", "WanMeshWan22ImageToVideoLatent.length"), flags=("generate --frames", "stream --frames"), flag_default=None,
          note="CLI default: the video's (VACE), 17 for the tiny models"),
    Field("batch_size", "INT", 1, "videos per run", 1, 64, nodes=("WanMeshEmptyLatent.batch_size",
          "WanMeshVaceEncode.batch_size", "WanMeshImageToVideo.batch_size", "WanMeshWan22ImageToVideoLatent.batch_size")),
    Field("fps", "FLOAT", 16.0, "frames per second of the written videos", 1.0, 120.0, 1.0, valid=Valid(0.0, 1000.0,
          low_open=True), nodes=("WanMeshSaveVideo.fps", "WanMeshStreamSampler.fps"),
          flags=("generate --fps", "stream --fps"), checked=("video_io.check_fps",)),
    Field("tile_px", "INT", 0, "VAE tile edge in pixels; 0: whole frames (or 256 with vae_patch > 1)", 0, 4096, 8,
          nodes=("WanMeshVAEDecode.tile_px", "WanMeshVAEEncode.tile_px"), flags=("generate --vae-tile",),
          flag_default=None),
    Field("overlap_px", "INT", 64, "VAE tile overlap in pixels; decode: as VAEDecodeTiled, above a quarter of "
          "the tile it is lowered to a quarter; encode: a multiple of 8, at most half the tile", 0, 2048,
          8, nodes=("WanMeshVAEDecode.overlap_px", "WanMeshVAEEncode.overlap_px"), flags=("generate --vae-overlap",),
          flag_default=None, note="CLI default: a quarter of the tile"),
    Field("vace_control", "CHOICE", CONTROL_MODES[0], "canny: white edges on black; scribble: thick edge strokes; "
          "gray: luminance; flow: optical flow as colour (hue = direction, brightness = speed); none: frames "
          "unchanged", choices=CONTROL_MODES, nodes=("WanMeshVaceControl.mode",), flags=("generate --vace-control",),
          flag_default=None, note="CLI: turns --vace-video into a control video; left out, the video as it is"),
    # -- sampling
    Field("seed", "INT", 0, "noise seed", 0, MAX_SEED, valid=Valid(0, MAX_SEED),
          nodes=("WanMeshSampler.seed", "WanMeshStreamSampler.seed"), flags=("generate --seed", "stream --seed"),
          checked=("SampleRequest.seed", "StreamSample.seed")),
    Field("steps", "INT", 30, "denoising steps", 1, 1000, valid=Valid(1), nodes=("WanMeshSampler.steps",),
          flags=("generate --steps",), checked=("SampleRequest.steps",), flag_default=None,
          note="CLI default: 10 for the tiny models"),
    Field("cfg", "FLOAT", 5.0, "classifier-free guidance scale; 1 runs one pass per step", 0.0, 100.0, 0.1,
          valid=Valid(0.0), nodes=("WanMeshSampler.cfg",), flags=("generate --guidance-scale",),
          checked=("SampleRequest.guidance_scale",), note="CLI alias --cfg"),
    Field("shift", "FLOAT", 5.0, "flow-matching timestep shift (5 for 720p/480p Wan 2.1)", 0.01, 100.0, 0.1,
          valid=Valid(0.0, low_open=True), nodes=("WanMeshSampler.shift",), flags=("generate --shift",),
          checked=("SampleRequest.shift",), flag_default=None, note="CLI default: 3 for the tiny models"),
    Field("sampler", "CHOICE", DEFAULT_SAMPLER, "uni_pc (as native Wan workflows), euler, euler_ancestral, dpmpp_2m "
          "and lcm: ComfyUI's samplers of those names with the same numbers, run in the workers; wan_unipc (older "
          "name: unipc): Wan's reference flow UniPC; in the node every other ComfyUI sampler runs through ComfyUI's "
          "own code on the pool",
          choices=SAMPLERS, nodes=("WanMeshSampler.sampler_name",), flags=("generate --sampler",),
          checked=("SampleRequest.sampler",)),
    Field("scheduler", "CHOICE", DEFAULT_SCHEDULER, "sigma schedule of ComfyUI's samplers, ComfyUI's names and numbers "
          "(wan_unipc / unipc keep Wan's own schedule); in the node every other ComfyUI scheduler runs through "
          "ComfyUI's own code on the pool", choices=SCHEDULERS, nodes=("WanMeshSampler.scheduler",),
          flags=("generate --scheduler",), checked=("SampleRequest.scheduler",)),
    Field("denoise", "FLOAT", 1.0, "1 starts from noise; less keeps part of the input latent", 0.01, 1.0, 0.01,
          valid=Valid(0.0, 1.0, low_open=True), nodes=("WanMeshSampler.denoise",), checked=("SampleRequest.denoise",)),
    Field("boundary", "FLOAT", T2V_EXPERT_BOUNDARY, "steps whose timestep is at or above boundary x 1000 run the "
          f"high-noise expert, the rest the low-noise one ({T2V_EXPERT_BOUNDARY}: Wan 2.2 T2V, {I2V_EXPERT_BOUNDARY}: "
          "I2V)", 0.0, 1.0, 0.001, valid=Valid(0.0, 1.0), nodes=("WanMeshSampler.boundary",),
          flags=("generate --boundary",), checked=("SampleRequest.boundary",)),
    Field("cfg_low_noise", "FLOAT", -1.0, "guidance scale of the low-noise expert's steps; -1: the same as cfg", -1.0,
          100.0, 0.1, valid=Valid(0.0), nodes=("WanMeshSampler.cfg_low_noise",), flags=("generate --cfg-low",),
          checked=("SampleRequest.guidance_scale_low",), flag_default=None, unset=-1.0,
          note="CLI default: --guidance-scale; the request holds None for -1"),
    Field("start_step", "INT", 0, "first step to run (like KSamplerAdvanced's start_at_step)", 0,
          END_STEP_TO_THE_END, valid=Valid(0), nodes=("WanMeshSampler.start_step",), flags=("generate --start-step",),
          checked=("SampleRequest.start_step",)),
    Field("end_step", "INT", END_STEP_TO_THE_END, "stop before this step and return the latent with its leftover "
          "noise; steps or more (10000): run to the end", 1, END_STEP_TO_THE_END, valid=Valid(1),
          nodes=("WanMeshSampler.end_step",), flags=("generate --end-step",), checked=("SampleRequest.end_step",),
          flag_default=None, unset=END_STEP_TO_THE_END, note="CLI default: the last step; the request holds None for the end"),
    Field("add_noise", "BOOLEAN", True, "off for a second chained sampler: the latent already holds the noise of "
          "start_step", nodes=("WanMeshSampler.add_noise",), checked=("SampleRequest.add_noise",)),
    # -- step caching
    Field("cache", "STRING", "", "step caching: METHOD[:THRESHOLD][:start=S][:end=E][:k=K][:coefficients=generic], "
          "METHOD teacache, magcache or fbcache, e.g. teacache:0.2; empty: every step computed",
          flags=("generate --cache", "stream --cache"), flag_default=None, note="the WanMesh Cache node in ComfyUI"),
    Field("cache_method", "CHOICE", "teacache", "teacache: the change of the timestep-modulated input; magcache: "
          "the published magnitude ratios of the residual; fbcache: the change of the first block's residual",
          choices=("teacache", "magcache", "fbcache"), nodes=("WanMeshCache.method",)),
    Field("cache_threshold", "FLOAT", 0.2, "how much change the skipped steps may add up to; higher skips more "
          "(published ranges: teacache 0.1-0.3, magcache 0.06-0.24, fbcache 0.05-0.15; 0 skips nothing)", 0.0,
          10.0, 0.01, nodes=("WanMeshCache.threshold",)),
    Field("cache_start", "FLOAT", 0.2, "share of the steps always computed first (MagCache's retention ratio)",
          0.0, 1.0, 0.01, nodes=("WanMeshCache.start_percent",)),
    Field("cache_end", "FLOAT", 1.0, "share of the steps after which every step is computed (1: none)", 0.0, 1.0,
          0.01, nodes=("WanMeshCache.end_percent",)),
    Field("cache_max_skips", "INT", 0, "most steps skipped in a row; 0: the method's default (MagCache's K of 2, "
          "no limit for the others)", 0, 1000, nodes=("WanMeshCache.max_skips",)),
    Field("cache_coefficients", "CHOICE", "auto", "auto: the published numbers of a released Wan model (the "
          "generic rule, logged, for other models); generic: the generic rule", choices=("auto", "generic"),
          nodes=("WanMeshCache.coefficients",)),
    # -- causal streaming
    Field("stream_steps", "INT", 4, "denoising steps per chunk (causal checkpoints use 4)", 1, 1000, valid=Valid(1),
          nodes=("WanMeshStreamSampler.steps",), flags=("stream --steps",), checked=("StreamSample.steps",)),
    Field("stream_shift", "FLOAT", 5.0, "timestep shift of the steps schedule (5 gives 1, 0.9375, 0.8333, 0.625)",
          0.01, 100.0, 0.1, valid=Valid(0.0, low_open=True), nodes=("WanMeshStreamSampler.shift",),
          flags=("stream --shift",), checked=("StreamSample.shift",)),
    Field("stream_cfg", "FLOAT", 1.0, "guidance scale; distilled causal checkpoints run at 1 (no negative pass)", 0.0,
          100.0, 0.1, valid=Valid(0.0), nodes=("WanMeshStreamSampler.cfg",), flags=("stream --guidance-scale",),
          checked=("StreamSample.guidance_scale",), note="CLI alias --cfg"),
    Field("chunk", "INT", 3, "latent frames per chunk (1 = frame by frame); a shorter last chunk is allowed", 1, 1024,
          valid=Valid(1), nodes=("WanMeshStreamSampler.chunk",), flags=("stream --chunk",),
          checked=("StreamSample.chunk",)),
    Field("switch_chunk", "INT", 1, "the chunk where a stream's prompt changes (chunk 0 takes the stream's own "
          "prompt); the cached frames are re-encoded under the new prompt", 1, 4096, valid=Valid(1),
          nodes=("WanMeshPromptSwitch.chunk",), note="CLI: the CHUNK of --prompt-at CHUNK:PROMPT"),
    Field("kv_window", "INT", 0, "latent frames kept in the KV cache; 0 keeps the whole video", 0, MAX_CACHE_FRAMES,
          valid=Valid(1), nodes=("WanMeshStreamSampler.kv_window",), flags=("stream --kv-window",),
          checked=("StreamSample.kv_window",), flag_default=None, unset=0,
          note="CLI: left out for the whole video; the request holds None for it"),
    Field("sink", "INT", 0, "first latent frames always kept in the cache when a window rolls", 0, MAX_CACHE_FRAMES,
          valid=Valid(0), nodes=("WanMeshStreamSampler.sink",), flags=("stream --sink",),
          checked=("StreamSample.sink",)),
    Field("reanchor", "BOOLEAN", False, "with a kv_window and sink frames: move the sink in time to sit right "
          "before the window's oldest frame, so that a stream past the trained length sees only the distances of "
          "one window; off: the sink keeps its place at the start (Self-Forcing's rolling cache)",
          nodes=("WanMeshStreamSampler.reanchor",), flags=("stream --reanchor",),
          checked=("StreamSample.reanchor",)),
    Field("timesteps", "STRING", "", "comma list of timesteps in (0, 1000], e.g. 1000,750,500,250, replacing steps "
          "and shift; empty: from steps and shift", nodes=("WanMeshStreamSampler.timesteps",),
          flags=("stream --timesteps",), checked=("StreamSample.timesteps",), flag_default=None, unset=""),
)
BY_KEY = {field.key: field for field in FIELDS}
FLAG_TYPES = {"INT": int, "FLOAT": float, "STRING": str}


def node_input(key: str, *, choices: list[str] | None = None, **options) -> tuple:
    """The ComfyUI input spec of a field: ``("INT", {default, min, max, step, tooltip})``, or for a choice
    ``([choices], {default, tooltip})``; ``choices`` widens a choice list (ComfyUI's samplers), ``options`` adds
    widget options (``multiline``)."""
    row = BY_KEY[key]
    spec: dict[str, Any] = {"default": row.default}
    for name, value in (("min", row.low), ("max", row.high), ("step", row.step)):
        if value is not None:
            spec[name] = value
    spec.update(options, tooltip=row.help)
    if row.kind == "CHOICE":
        return list(choices or row.choices), spec
    return row.kind, spec  # INT, FLOAT, BOOLEAN and STRING are ComfyUI's own type names


def flag_of(key: str, command: str) -> str:
    """The field's flag in one command (``--steps``); KeyError when the command has none."""
    for entry in BY_KEY[key].flags:
        name, _, flag = entry.partition(" ")
        if name == command:
            return flag
    raise KeyError(f"{key} has no flag in `wanmesh {command}`")


def add_flag(parser, key: str, command: str, *aliases: str, dest: str | None = None):
    """Add a field's flag to an argparse parser (or group): type, default, choices and help from the row."""
    row = BY_KEY[key]
    flag = flag_of(key, command)
    options: dict[str, Any] = {"help": flag_help(row), "dest": dest or flag.lstrip("-").replace("-", "_")}
    if row.kind == "BOOLEAN":
        return parser.add_argument(flag, *aliases, action="store_true", **options)
    if row.kind == "CHOICE":
        options["choices"] = row.choices
    else:
        options["type"] = FLAG_TYPES[row.kind]
    return parser.add_argument(flag, *aliases, default=row.cli_default, **options)


def flag_help(row: Field) -> str:
    """A flag's help: the field's, with its note and the default."""
    default = "" if row.kind == "BOOLEAN" or row.cli_default is None else "; default %(default)s"
    return row.help + (f" ({row.note})" if row.note else "") + default


def _number(value: float) -> str:
    if value == MAX_SEED:
        return "2**64-1"
    return f"{value:g}" if isinstance(value, float) and not value.is_integer() else str(int(value))


def _default_text(row: Field) -> str:
    text = repr(row.default) if row.kind in ("STRING", "CHOICE") else str(row.default).lower() \
        if row.kind == "BOOLEAN" else _number(row.default)
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The settings table of docs/settings.md, one row per field."""
    lines = ["| setting | node inputs | command line | default | widget | checked | meaning |",
             "|---|---|---|---|---|---|---|"]
    for row in FIELDS:
        widget = ", ".join(row.choices) if row.kind == "CHOICE" else (
            f"{_number(row.low)}..{_number(row.high)}" if row.low is not None else "")
        nodes = ", ".join(f"`{entry.replace('WanMesh', '', 1)}`" for entry in row.nodes)
        flags = ", ".join(f"`{entry}`" for entry in row.flags)
        meaning = row.help + (f" ({row.note})" if row.note else "")
        checked = row.valid.text() if row.valid else "listed" if row.kind == "CHOICE" and row.checked else ""
        lines.append("| " + " | ".join(_cell(part) for part in (f"`{row.key}`", nodes, flags, _default_text(row),
                                                                   widget, checked, meaning)) + " |")
    return "\n".join(lines)


SETTINGS_PAGE = "docs/settings.md"
TABLE_START = f"<!-- settings table: python -m wanmesh.parallel.fields {SETTINGS_PAGE} -->"
TABLE_END = "<!-- end of settings table -->"


def page_with_table(text: str) -> str:
    """``text`` (docs/settings.md) with the settings table between its markers replaced by :func:`markdown_table`."""
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    return f"{text[:start]}\n{markdown_table()}\n{text[end:]}"


def main(argv: list[str]) -> int:
    """Rewrite the settings table in the page given (docs/settings.md; print the table when no file is given)."""
    if not argv:
        print(markdown_table())
        return 0
    with open(argv[0], encoding="utf-8") as file:
        text = file.read()
    with open(argv[0], "w", encoding="utf-8") as file:
        file.write(page_with_table(text))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
