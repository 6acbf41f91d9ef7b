"""One validation pass before any work: everything checkable without a GPU, model weights or a worker; runs
in the driver (the CLI process, or ComfyUI's for the nodes).

It reads file headers only (safetensors JSON headers, GGUF tensor indexes, the zip signature of PyTorch
checkpoints) and the tokenizer bytes of a umT5 file, never model weights. The numeric checks themselves live in
``config.py`` (one place for each check); this module applies them to a whole request and adds the file,
output-path, prompt-length and rank checks. Errors are one-line ``ValueError``s naming the value and what is valid;
warnings come back as strings for the caller to print or log.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .config import (
    DEFAULT_SAMPLER,
    LATENT_CHANNELS,
    TEXT_TOKENS,
    WAN22_LATENT_CHANNELS,
    ParallelConfig,
    check_head_split,
    check_seed,
    check_steps,
    check_sampling,
    check_tiles,
    check_video_size,
    ranks_over_cores_warning,
)
from .weights.checkpoint import PICKLE_SUFFIXES, SCALED_FP8_MARKER, ModelFileError, scale_key_for
from .weights.vae22_keys import is_wan22_vae
from .weights.detect import (
    KIND_DESCRIPTIONS,
    UNSUPPORTED_FAMILIES,
    detect_kind,
    image_inputs,
    infer_transformer_config,
    infer_umt5_config,
    read_header,
    unsupported_family_error,
)

log = logging.getLogger("wanmesh")
TOKENS_PER_WORD_ESTIMATE = 1.5  # used only when the tokenizer cannot be read cheaply; umT5 averages ~1.3-1.6

TRANSFORMER_KINDS = ("wan_t2v", "wan_vace", "wan_i2v", "diffusers_transformer", "wan_animate", "wan_humo")
# the transformer kinds in a refusal line (each kind's own description is in the log line)
TRANSFORMERS_IN_SHORT = "a Wan transformer (T2V, full VACE, I2V or Animate; original or diffusers key layout)"
VAE_KINDS = ("wan_vae", "diffusers_vae")
TEXT_ENCODER_KINDS = ("umt5",)
VACE_MODULE_KINDS = ("vace_module", "wan_vace")
FP8_PREFIX = "F8_"  # safetensors' fp8 dtype names: F8_E4M3, F8_E5M2


# -- model files ---------------------------------------------------------------------------------------------


@dataclass
class ModelFileInfo:
    """What the header of a model file (or a diffusers folder's config) says: every tensor's logical shape and
    stored type, and the file's metadata (empty for folders and pickles)."""

    path: Path
    kind: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # safetensors dtype names (F8_E4M3, ...) or GGUF types
    metadata: dict[str, str] = field(default_factory=dict)


MAX_MESSAGE = 300  # a refusal is one line of at most this many characters; the details go to the log


def shortest_fitting(*variants: str) -> str:
    """The first of ``variants`` (most detailed first) that fits in ``MAX_MESSAGE`` characters, else the last cut
    to it: long paths and tensor names must not push a refusal past one short line."""
    for message in variants:
        if len(message) <= MAX_MESSAGE:
            return message
    return variants[-1][:MAX_MESSAGE]


def _refuse_pickle(path: Path, flag: str) -> None:
    """Legacy (pre-1.6, non-zip) PyTorch pickles cannot be loaded weights-only or memory-mapped: refuse them
    here with the fix, instead of the loader's mmap error. Zip-format checkpoints are read weights-only here
    (memory-mapped: the pickle, not the weights), so one holding anything but tensors is refused before any worker
    starts."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{flag} {path} is a legacy PyTorch pickle (not the zip format of torch >= 1.6); it cannot "
                         "be loaded safely: convert it to .safetensors")
    from .weights.checkpoint import _load_pickle_state_dict

    try:
        _load_pickle_state_dict(path)
    except ModelFileError as error:
        raise ValueError(f"{flag} {error}") from None


def inspect_model_file(path: str | Path, flag: str, expected: tuple[str, ...]) -> ModelFileInfo:
    """The file or folder exists and its header says it is one of the ``expected`` kinds (``detect.py`` names);
    a GGUF file's own checks (architecture, tensor types, latent channels) and the scaled-fp8 scales too."""
    location = Path(path)
    if location.is_dir():
        return _inspect_folder(location, flag)
    if not location.is_file():
        raise ValueError(f"{flag} {location} does not exist; give a model file (.safetensors, .gguf) or a diffusers "
                         "folder")
    if location.suffix.lower() in PICKLE_SUFFIXES:
        _refuse_pickle(location, flag)
        return ModelFileInfo(location, "pickle")
    try:
        info = _read_header(location)
    except ModelFileError as error:
        raise ValueError(f"{flag} {error}") from None
    except OSError as error:
        raise ValueError(f"{flag} {location} cannot be read ({error.strerror})") from None
    if info.kind in UNSUPPORTED_FAMILIES:
        raise ValueError(shortest_fitting(f"{flag} {unsupported_family_error(location, info.kind)}",
                                          f"{flag} {unsupported_family_error(location.name, info.kind)}"))
    if info.kind not in expected:
        raise ValueError(kind_refusal(flag, location, info.kind, expected))
    check_fp8_scales(info, flag)
    return info




def _kind_name(kind: str) -> str:
    """A kind's description without its key list ("a Wan VAE, 2.1 or 2.2")."""
    return KIND_DESCRIPTIONS[kind].split(" (")[0]


def kind_refusal(flag: str, location: Path, kind: str, expected: tuple[str, ...]) -> str:
    """One line for a file of the wrong kind (the key lists of every kind go to the log, not into the line)."""
    log.info("%s %s: its keys look like %s; expected %s", flag, location, KIND_DESCRIPTIONS[kind],
             " or ".join(KIND_DESCRIPTIONS[k] for k in expected))
    wanted = (TRANSFORMERS_IN_SHORT if tuple(expected) == TRANSFORMER_KINDS
              else " or ".join(dict.fromkeys(_kind_name(k) for k in expected)))
    hint = "; load a Wan T2V model and give this file as its VACE module" if kind == "vace_module" else ""
    return shortest_fitting(f"{flag} {location} looks like {_kind_name(kind)}; expected {wanted}{hint}",
                            f"{flag} {location.name} looks like {_kind_name(kind)}; expected {wanted}{hint}")


def _read_header(location: Path) -> ModelFileInfo:
    """Shapes, stored types and metadata from a GGUF tensor index or a safetensors JSON header; no weight read."""
    header = read_header(location)
    return ModelFileInfo(location, detect_kind(header.shapes), header.shapes, header.dtypes, header.metadata)


def _inspect_folder(folder: Path, flag: str) -> ModelFileInfo:
    if not ((folder / "config.json").is_file() or (folder / "model_index.json").is_file()):
        raise ValueError(f"{flag} {folder} is a folder without config.json or model_index.json; give a model file "
                         "or a diffusers model folder")
    return ModelFileInfo(folder, "folder")


def has_vace_blocks(paths: list[str]) -> bool:
    """Whether a transformer loaded from ``paths`` (its file or folder, then its VACE module) has VACE blocks:
    read from the headers (a VACE file or module) or a diffusers folder's config (``vace_layers``)."""
    for path in map(Path, paths):
        if path.is_dir():
            config = path / "transformer" / "config.json" if (path / "model_index.json").is_file() else path / "config.json"
            if config.is_file() and json.loads(config.read_text()).get("vace_layers"):
                return True
        elif path.suffix.lower() not in PICKLE_SUFFIXES and _read_header(path).kind in ("wan_vace", "vace_module"):
            return True
    return False


def model_image_inputs(path: str | Path, flag: str = "model") -> tuple[int, str | None]:
    """(input channels, ``detect.image_inputs`` kind) of the transformer at ``path``, from its header or config:
    what image conditioning it takes (the native MODEL and the image-to-video checks need it); errors name ``flag``."""
    config = transformer_config(inspect_model_file(path, flag, TRANSFORMER_KINDS)) or {}
    return config.get("in_channels", LATENT_CHANNELS), image_inputs(config)


def vae_latent_channels(info: ModelFileInfo) -> int | None:
    """The latent channels of a VAE file (48: the Wan 2.2 VAE's nested layout, 16: the Wan 2.1 VAE's), from its
    header; None for a folder or a file whose kind the header does not tell."""
    if info.kind != "wan_vae":
        return None
    keys = {key.removeprefix(prefix) for key in info.shapes for prefix in ("first_stage_model.", "vae.")}
    return WAN22_LATENT_CHANNELS if is_wan22_vae(keys) else LATENT_CHANNELS


VAE_NAMES = {LATENT_CHANNELS: "the Wan 2.1 VAE (wan_2.1_vae.safetensors)",
             WAN22_LATENT_CHANNELS: "the Wan 2.2 VAE (wan2.2_vae.safetensors)"}


def check_latents_for_vae(channels: int, vae_path: str | Path, latents_flag: str, vae_flag: str) -> None:
    """Latents of ``channels`` channels are of the VAE's latent space (16: Wan 2.1's, 48: Wan 2.2's), from its
    header: a decode of another model's latents is refused before the pool runs it."""
    vae_channels = vae_latent_channels(inspect_model_file(vae_path, vae_flag, VAE_KINDS))
    if vae_channels is not None and channels in VAE_NAMES and channels != vae_channels:
        raise ValueError(f"{latents_flag} are {channels}-channel latents, but {vae_flag} {Path(vae_path).name} is "
                         f"{VAE_NAMES[vae_channels]}: decode them with {VAE_NAMES[channels]}")


def check_vae_for_model(vae: ModelFileInfo, model_path: str | Path, vae_flag: str, model_flag: str) -> None:
    """The VAE's latent space is the model's: the Wan 2.2 VAE (48 channels) for TI2V 5B, the Wan 2.1 VAE (16) for
    every other Wan model (Wan 2.1, Wan 2.2 A14B); a one-line error naming what to use instead."""
    vae_channels = vae_latent_channels(vae)
    in_channels, kind = model_image_inputs(model_path, model_flag)
    model_channels = WAN22_LATENT_CHANNELS if kind == "first_frame" else LATENT_CHANNELS
    if vae_channels is not None and vae_channels != model_channels:
        names = VAE_NAMES
        raise ValueError(f"{vae_flag} {Path(vae.path).name} is {names[vae_channels]}, but {model_flag} "
                         f"{Path(model_path).name} works on {model_channels}-channel latents: use "
                         f"{names[model_channels]} with it")


def check_fp8_scales(info: ModelFileInfo, flag: str) -> None:
    """A file with ComfyUI's ``scaled_fp8`` marker stores each fp8 linear weight divided by its ``scale_weight``:
    one missing scale leaves that layer wrong by its factor, so such a file is refused. Scales without the
    marker are fine (they are applied wherever they are)."""
    if not any(key.endswith(SCALED_FP8_MARKER) for key in info.shapes):
        return
    linears = [key for key, shape in info.shapes.items()
               if len(shape) == 2 and key.endswith(".weight") and info.dtypes.get(key, "").startswith(FP8_PREFIX)]
    unscaled = [key for key in linears if scale_key_for(key) not in info.shapes]
    if unscaled:
        missing = f"its fp8 weight {unscaled[0]} has no {scale_key_for(unscaled[0])}"
        advice = "the file is incomplete; use the complete scaled-fp8 file"
        raise ValueError(shortest_fitting(
            f"{flag} {info.path} has ComfyUI's {SCALED_FP8_MARKER} marker but {missing} ({len(unscaled)} of "
            f"{len(linears)} fp8 linear weights lack their scale): {advice}",
            f"{flag} {info.path.name} has ComfyUI's {SCALED_FP8_MARKER} marker but {missing} ({len(unscaled)} of "
            f"{len(linears)} lack one): {advice}",
            f"{flag} {info.path.name} has ComfyUI's {SCALED_FP8_MARKER} marker but {missing}: {advice}"))


def transformer_config(info: ModelFileInfo) -> dict | None:
    """The transformer's config (heads, FFN width, layers, ...) from the header or the folder's config.json;
    None when neither tells."""
    if info.shapes:
        try:
            return infer_transformer_config(info.shapes, info.metadata)
        except ModelFileError as error:
            raise ValueError(shortest_fitting(f"{info.path}: {error}", f"{info.path.name}: {error}")) from None
    config_file = info.path / "transformer" / "config.json"
    config_file = config_file if config_file.is_file() else info.path / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def transformer_shape(info: ModelFileInfo) -> tuple[int, int] | None:
    """(attention heads, FFN width) from the header or the folder's config.json; None when neither tells."""
    config = transformer_config(info)
    if config is None or "num_attention_heads" not in config or "ffn_dim" not in config:
        return None
    return int(config["num_attention_heads"]), int(config["ffn_dim"])


def _named(flag: str, path: Path, message: str) -> str:
    """``message`` naming the input that gave the file: after a node's ``input file:``, or ending in ``(--flag
    file)`` on the command line (its message starts with the value, as the other flag checks' do)."""
    return f"{flag} {message}" if flag.endswith(":") else f"{message} ({flag} {path.name})"


def check_model_split(info: ModelFileInfo, config: ParallelConfig, flag: str | None = None) -> None:
    """tp and ulysses against the model's head count (and tp against its FFN width), read from the header; the
    error names the file after ``flag`` when given."""
    shape = transformer_shape(info)
    if shape is not None:
        heads, ffn_dim = shape
        try:
            check_head_split(heads, tp=config.tp, ulysses=config.ulysses, ffn_dim=ffn_dim)
        except ValueError as error:
            if flag is None:
                raise
            raise ValueError(_named(flag, info.path, str(error))) from None


def text_encoder_shape(info: ModelFileInfo) -> tuple[int, int, int] | None:
    """(width d_model, attention heads, FFN width) of a umT5 file from its header, or a folder's config.json;
    None when neither tells."""
    if info.shapes:
        try:
            config = infer_umt5_config({key: shape for key, shape in info.shapes.items() if key != "spiece_model"})
        except ModelFileError:
            return None
    else:
        config_file = info.path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not all(key in config for key in ("d_model", "num_heads", "d_ff")):
        return None
    return int(config["d_model"]), int(config["num_heads"]), int(config["d_ff"])


def check_text_encoder_split(info: ModelFileInfo, config: ParallelConfig, flag: str) -> None:
    """The text encoder runs tensor-parallel over the pool's tp: tp must divide its heads and FFN width."""
    shape = text_encoder_shape(info)
    if shape is not None and config.tp > 1:
        _, heads, ffn_dim = shape
        try:
            check_head_split(heads, tp=config.tp, ffn_dim=ffn_dim)
        except ValueError as error:
            raise ValueError(_named(flag, info.path, str(error).replace("the model", "the text encoder"))) from None


def check_text_encoder_for_model(text_encoder: str | Path, model: str | Path, text_flag: str, model_flag: str) -> None:
    """The text encoder's width is the width the model's text embedding reads (4096: umT5-XXL), from both headers."""
    shape = text_encoder_shape(inspect_model_file(text_encoder, text_flag, TEXT_ENCODER_KINDS))
    model_config = transformer_config(inspect_model_file(model, model_flag, TRANSFORMER_KINDS)) or {}
    text_dim = model_config.get("text_dim")
    if shape is not None and text_dim is not None and shape[0] != int(text_dim):
        raise ValueError(f"{text_flag} {Path(text_encoder).name} gives {shape[0]}-wide text embeddings, but {model_flag} "
                         f"{Path(model).name} reads {text_dim}-wide ones: use the text encoder made for this model")


def check_model_partners(model: str | Path, model_flag: str, *, vae: tuple[str | Path, str] | None = None,
                         text_encoder: tuple[str | Path, str] | None = None) -> None:
    """The files used with a transformer, from the headers before anything loads: the VAE's latent space and the
    text encoder's width against the model's. ``vae`` and ``text_encoder``: (file, the input that named it). The
    command line and the nodes' prompt check (``nodes/bridge/prompt_checks.py``) both call this."""
    if vae is not None:
        check_vae_for_model(inspect_model_file(vae[0], vae[1], VAE_KINDS), model, vae[1], model_flag)
    if text_encoder is not None:
        check_text_encoder_for_model(text_encoder[0], model, text_encoder[1], model_flag)


def check_embedding_width(width: int, model: str | Path, model_flag: str, where: str) -> None:
    """Prompt embeddings (``where``: what made them) as wide as the model's text embedding reads, from its header."""
    model_config = transformer_config(inspect_model_file(model, model_flag, TRANSFORMER_KINDS)) or {}
    text_dim = model_config.get("text_dim")
    if text_dim is not None and int(width) != int(text_dim):
        raise ValueError(f"{where} are {width} wide, but {model_flag} {Path(model).name} reads {text_dim}-wide text "
                         "embeddings: use the text encoder made for this model")


MODEL_KINDS = {"model": TRANSFORMER_KINDS, "vae": VAE_KINDS, "text_encoder": TEXT_ENCODER_KINDS,
               "vace_module": VACE_MODULE_KINDS}


def check_model_file(path: str | Path, role: str, name: str, config: ParallelConfig | None = None) -> None:
    """One model file for a loader (``role``: a key of ``MODEL_KINDS``; ``name`` is what the user picked),
    headers only; a transformer's head split is checked against ``config`` when given."""
    info = inspect_model_file(path, name, MODEL_KINDS[role])
    if role == "model" and config is not None:
        check_model_split(info, config, name)
    if role == "text_encoder" and config is not None:
        check_text_encoder_split(info, config, name)


# -- LoRA values ---------------------------------------------------------------------------------------------


def check_lora_values(path: str | Path, flag: str) -> None:
    """Every tensor of a LoRA file is finite: a NaN or an infinity would be merged into the weights and show only
    as NaN latents after a step. LoRAs are small, so the driver reads them (once per file version)."""
    location = Path(path)
    stat = location.stat()
    bad = _first_non_finite(str(location), stat.st_mtime_ns, stat.st_size)
    if bad is not None:
        key, what = bad
        subject = flag if flag.endswith(":") else f"{flag} {location.name}:"
        raise ValueError(f"{subject} holds {what} values (tensor {key}): the file is damaged; use another copy of "
                         "the LoRA")


@functools.lru_cache(maxsize=64)
def _first_non_finite(path: str, mtime_ns: int, size: int) -> tuple[str, str] | None:
    import torch
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return key, "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
    return None


# -- output paths --------------------------------------------------------------------------------------------


def check_output_path(path: str | Path, flag: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """A path a file can be written to: missing parent folders are created, and a probe file is written and
    removed in the folder (the only reliable test: permissions, read-only mounts and ACLs all show)."""
    target = Path(path)
    if suffixes and target.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {target} has the suffix {target.suffix or '(none)'!r}; valid: {', '.join(suffixes)}")
    if target.is_dir():
        raise ValueError(f"{flag} {target} is a folder; give a file name")
    try:
        _probe_writable(target.parent, target.name)
    except OSError as error:
        raise ValueError(f"{flag} {target} cannot be written ({error.strerror}: {error.filename or target.parent}); "
                         "give a path in a folder you can write to") from None
    return target


def _probe_writable(folder: Path, name: str) -> None:
    """Make ``folder`` (when missing) and create and remove a hidden file in it; raises OSError where it can't."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".{name}.{secrets.token_hex(4)}.probe"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    probe.unlink()


def check_chunk_folder(folder: str | Path, flag: str) -> Path:
    """A folder the stream's chunk files can be written to (made when missing), probed before any chunk is made."""
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {target} is a file; give a folder for the chunk files")
    try:
        _probe_writable(target, "chunk")
    except OSError as error:
        raise ValueError(f"{flag} {target} cannot take the chunk files ({error.strerror}); give a folder you can "
                         "write to") from None
    return target


# -- prompt length -------------------------------------------------------------------------------------------


def _tokenizer(text_encoder: str | Path):
    """umT5's SentencePiece model read from the file's `spiece_model` tensor (a few MB, no weights) or the
    folder's spiece.model; None when neither is there."""
    import sentencepiece

    location = Path(text_encoder)
    if location.is_dir():
        for candidate in (location / "spiece.model", location.parent / "tokenizer" / "spiece.model"):
            if candidate.is_file():
                return sentencepiece.SentencePieceProcessor(model_file=str(candidate))
        return None
    from safetensors import safe_open

    with safe_open(str(location), framework="pt") as handle:
        if "spiece_model" not in handle.keys():
            return None
        model_proto = handle.get_tensor("spiece_model").numpy().tobytes()
    return sentencepiece.SentencePieceProcessor(model_proto=model_proto)


def count_prompt_tokens(prompt: str, text_encoder: str | Path | None) -> tuple[int, bool]:
    """(tokens including EOS, exact?): counted with the encoder's own tokenizer when it can be read cheaply,
    else estimated from the word count (``TOKENS_PER_WORD_ESTIMATE``). Whitespace is collapsed as the
    encoder's prompt cleaning does; its ftfy/HTML fixes rarely change the count."""
    text = re.sub(r"\s+", " ", prompt).strip()
    tokenizer = None
    if text_encoder is not None:
        try:
            tokenizer = _tokenizer(text_encoder)
        except Exception:  # noqa: BLE001 - an unreadable tokenizer only makes this an estimate
            tokenizer = None
    if tokenizer is not None:
        return len(tokenizer.encode(text)) + 1, True
    return int(len(text.split()) * TOKENS_PER_WORD_ESTIMATE) + 1, False


def prompt_length_warning(prompt: str, text_encoder: str | Path | None, what: str = "prompt") -> str | None:
    tokens, exact = count_prompt_tokens(prompt, text_encoder)
    if tokens <= TEXT_TOKENS:
        return None
    about = "" if exact else "about "
    return (f"the {what} is {about}{tokens} tokens; Wan reads the first {TEXT_TOKENS}, so {about}{tokens - TEXT_TOKENS} "
            "tokens at its end are dropped")


# -- ranks ---------------------------------------------------------------------------------------------------


def check_ranks(config: ParallelConfig) -> list[str]:
    """Every rank has a device (a bad device list fails here, before any existing pool is touched); a warning
    when CPU ranks outnumber the cores."""
    warning = ranks_over_cores_warning(config, os.cpu_count() or 1)
    return [warning] if warning else []


# -- a whole generate request --------------------------------------------------------------------------------


@dataclass
class GenerateInputs:
    """What one text-to-video run asks for, as plain values (the CLI's flags, or a node graph's inputs)."""

    width: int
    height: int
    frames: int
    steps: int
    shift: float
    guidance_scale: float
    seed: int
    sampler: str = DEFAULT_SAMPLER
    denoise: float = 1.0
    prompts: tuple[str, ...] = ()
    model: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    vace_module: str | None = None
    outputs: dict[str, tuple[str, tuple[str, ...] | None]] = field(default_factory=dict)  # flag -> (path, suffixes)
    tile_px: int | None = None
    overlap_px: int | None = None


def validate_generate(request: GenerateInputs, config: ParallelConfig) -> list[str]:
    """Every check of one run, cheapest first; raises the first problem as a one-line ValueError and returns
    the warnings (prompt tokens dropped, ranks over cores)."""
    check_video_size(request.width, request.height, request.frames)
    check_steps(request.steps)
    check_sampling(sampler=request.sampler, steps=request.steps, shift=request.shift, denoise=request.denoise,
                   guidance_scale=request.guidance_scale)
    check_seed(request.seed)
    check_tiles(request.tile_px, request.overlap_px)
    for flag, (path, suffixes) in request.outputs.items():
        if path is not None:
            check_output_path(path, flag, suffixes)
    if request.model is not None:
        model = inspect_model_file(request.model, "--model", TRANSFORMER_KINDS)
        check_model_split(model, config, "--model")
    if request.vace_module is not None:
        inspect_model_file(request.vace_module, "--vace-module", VACE_MODULE_KINDS)
    if request.vae is not None:
        inspect_model_file(request.vae, "--vae", VAE_KINDS)
    if request.text_encoder is not None:
        text_encoder = inspect_model_file(request.text_encoder, "--text-encoder", TEXT_ENCODER_KINDS)
        check_text_encoder_split(text_encoder, config, "--text-encoder")
    if request.model is not None:
        check_model_partners(request.model, "--model",
                             vae=None if request.vae is None else (request.vae, "--vae"),
                             text_encoder=None if request.text_encoder is None else (request.text_encoder,
                                                                                     "--text-encoder"))
    warnings = check_ranks(config)
    for what, prompt in zip(("prompt", "negative prompt"), request.prompts):
        warning = prompt_length_warning(prompt, request.text_encoder, what)
        if warning:
            warnings.append(warning)
    return warnings
