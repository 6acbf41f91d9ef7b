"""Model loaders: Wan / VACE transformers and the Wan VAEs (2.1 and 2.2), read from their files; runs in the workers.

Each loader accepts a ComfyUI-style single file in the original key layout, a diffusers model folder
(`config.json` + safetensors, maybe sharded) or a diffusers pipeline folder (`model_index.json` with
one sub-folder per component). Loading is "name map + per-tensor reader": the file is described as
{model parameter name: stored tensor} without reading tensors, the config is inferred from shapes, the
model is built on the meta device and every tensor is read exactly once into it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import (
    convert_wan_transformer_to_diffusers,
    convert_wan_vae_to_diffusers,
)

from .checkpoint import (
    COMFY_TRANSFORMER_PREFIX,
    CheckpointFile,
    ModelFileError,
    TensorRef,
    WeightSource,
    build_empty,
    list_safetensors_shards,
    load_weights_into,
    rename_map,
    resolve_model_location,
    strip_prefix,
)
from .gguf_file import open_files
from .vae22_keys import WAN22_LATENT_CHANNELS, check_wan22_folder_config, convert_wan22_vae_keys, is_wan22_vae
from ..networks.reference import add_reference_conv
from ..networks.wan_animate import ANIMATE_PREFIXES, WanAnimateTransformer, released_animate_name
from ..networks.wan_inputs import with_native_inputs
from ..networks.wan_camera import WanCameraTransformer3DModel
from ..networks.wan_humo import WanHumoTransformer3DModel
from ..networks.wan_vace import WanVaceMultiContext
from .detect import (
    ANIMATE_CLASS,
    HUMO_BLOCK_PART,
    HUMO_CLASS,
    HUMO_PREFIXES,
    REF_CONV_CHANNELS,
    UNSUPPORTED_FAMILIES,
    WAN21_LATENT_CHANNELS,
    check_latent_channels,
    describe_kind,
    detect_kind,
    infer_transformer_config,
    infer_vae_config,
    unsupported_family_error,
)

__all__ = ["build_transformer", "load_transformer", "load_vae", "transformer_weight_source"]

# diffusers' class names (as in config.json) -> the class that is built; VACE gets several-context support, a Fun
# Camera file (a ``camera_in_channels`` config) the camera adapter.
TRANSFORMER_CLASSES = {"WanTransformer3DModel": WanTransformer3DModel, "WanVACETransformer3DModel": WanVaceMultiContext,
                       "WanCameraTransformer3DModel": WanCameraTransformer3DModel, ANIMATE_CLASS: WanAnimateTransformer,
                       HUMO_CLASS: WanHumoTransformer3DModel}
DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model"
VAE_PREFIXES = ("first_stage_model.", "vae.")


def _read_folder_config(folder: Path, accepted_classes: set[str], component: str) -> dict:
    config = json.loads((folder / "config.json").read_text())
    class_name = config.get("_class_name")
    if class_name not in accepted_classes:
        raise ModelFileError(
            f"{folder}/config.json describes a {class_name or 'model without _class_name'}; expected a {component} "
            f"({' or '.join(sorted(accepted_classes))})."
        )
    return config


def _identity_source(folder: Path, stack: contextlib.ExitStack, weights_name: str) -> WeightSource:
    files = open_files(list_safetensors_shards(folder, weights_name), stack)
    refs = {key: TensorRef(file, key) for file in files for key in file.weight_keys()}
    return WeightSource(refs, str(folder))


def _wrong_kind(path: Path, expected: str, keys: list[str]) -> ModelFileError:
    return ModelFileError(f"{path}: expected {expected}, but this looks like {describe_kind(keys)}.")


# diffusers' converter has no name for FLF2V's learned image-token position embedding; everything else is its own.
EXTRA_TRANSFORMER_KEYS = {"img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}


BLUR_BUFFER_SUFFIX = ".kernel"  # the Animate motion encoder's fixed blur filters, if a file stores them: recomputed


def convert_wan_transformer_keys(checkpoint: dict) -> dict:
    """diffusers' Wan key converter (original layout -> diffusers names), with the keys it does not know; the
    Animate modules keep their released names (``networks/wan_animate.py``)."""
    extra = {EXTRA_TRANSFORMER_KEYS[key]: checkpoint.pop(key) for key in list(checkpoint) if key in EXTRA_TRANSFORMER_KEYS}
    animate = {released_animate_name(key): checkpoint.pop(key) for key in list(checkpoint)
               if key.startswith(ANIMATE_PREFIXES)}
    animate = {name: value for name, value in animate.items() if not name.endswith(BLUR_BUFFER_SUFFIX)}
    humo = {key: checkpoint.pop(key) for key in list(checkpoint)
            if key.startswith(HUMO_PREFIXES) or HUMO_BLOCK_PART in key}
    return {**convert_wan_transformer_to_diffusers(checkpoint), **extra, **animate, **humo}


def _original_transformer_source(checkpoint: CheckpointFile) -> tuple[WeightSource, dict[str, tuple[int, ...]]]:
    """Name map (diffusers name -> stored key) and prefix-free shapes of an original-layout file."""
    unprefixed_to_stored = strip_prefix(checkpoint.weight_keys(), COMFY_TRANSFORMER_PREFIX)
    diffusers_to_unprefixed = rename_map(unprefixed_to_stored, convert_wan_transformer_keys)
    refs = {name: TensorRef(checkpoint, unprefixed_to_stored[original])
            for name, original in diffusers_to_unprefixed.items()}
    shapes = {original: checkpoint.shape(stored) for original, stored in unprefixed_to_stored.items()}
    return WeightSource(refs, str(checkpoint.path)), shapes


def _open_vace_module(path: str | Path, stack: contextlib.ExitStack):
    module_path = resolve_model_location(path, "transformer")
    if module_path.is_dir():
        raise ModelFileError(f"{module_path}: a VACE module must be a single file holding only vace_* tensors.")
    (module,) = open_files([module_path], stack)
    kind = detect_kind(module.keys)
    if kind == "wan_vace":
        raise ModelFileError(
            f"{module_path}: this is a full VACE model (it has blocks.* as well as vace_*), not a VACE module; "
            f"load it directly as the model, without a VACE module."
        )
    if kind != "vace_module":
        raise _wrong_kind(module_path, "a VACE module (only vace_* tensors)", module.keys)
    return module


def transformer_weight_source(
    path: str | Path, vace_module: str | Path | None, stack: contextlib.ExitStack
) -> tuple[type, dict, WeightSource]:
    """(model class, config kwargs, weight source) for a transformer file/folder, plus an optional VACE module.

    Files stay open until `stack` closes, so callers (e.g. tensor-parallel ranks) can read slices.
    """
    location = resolve_model_location(path, "transformer")
    if location.is_dir():
        config = _read_folder_config(location, set(TRANSFORMER_CLASSES) - {ANIMATE_CLASS}, "Wan transformer")
        check_latent_channels(config.get("in_channels", WAN21_LATENT_CHANNELS))
        source = _identity_source(location, stack, DIFFUSERS_WEIGHTS_NAME)
        shapes = None
    else:
        (checkpoint,) = open_files([location], stack)
        kind = detect_kind(checkpoint.keys)
        if kind == "vace_module":
            raise ModelFileError(
                f"{location}: this is a VACE module (only vace_* tensors), not a complete model; load a Wan T2V "
                f"model and pass this file as its VACE module."
            )
        if kind in UNSUPPORTED_FAMILIES:
            raise ModelFileError(unsupported_family_error(location, kind))
        if kind not in ("wan_t2v", "wan_vace", "wan_i2v", "wan_animate", "wan_humo"):
            raise _wrong_kind(location, "a Wan transformer (keys patch_embedding, blocks.N.*)", checkpoint.keys)
        source, shapes = _original_transformer_source(checkpoint)
        config = infer_transformer_config(shapes, checkpoint.metadata)
    if vace_module is not None:
        if "vace_layers" in config or config.get("_class_name") == "WanVACETransformer3DModel":
            raise ModelFileError(f"{location}: already a VACE model; a separate VACE module cannot be added to it.")
        module_source, module_shapes = _original_transformer_source(_open_vace_module(vace_module, stack))
        _check_vace_module_width(config, module_shapes, location, vace_module)
        source = source.merged_with(module_source)
        config = _add_vace_config(config, shapes, module_shapes)
    class_name = config.get("_class_name") or (
        "WanVACETransformer3DModel" if "vace_layers" in config
        else "WanCameraTransformer3DModel" if "camera_in_channels" in config else "WanTransformer3DModel")
    return TRANSFORMER_CLASSES[class_name], config, source


def _check_vace_module_width(config: dict, module_shapes: dict, base: Path, module: str | Path) -> None:
    base_width = config["num_attention_heads"] * config["attention_head_dim"]
    module_width = module_shapes["vace_patch_embedding.weight"][0]
    if module_width != base_width:
        raise ModelFileError(
            f"the VACE module {Path(module).name} is for a model of width {module_width} but the base model "
            f"{base.name} has width {base_width}; use the VACE module made for this base model")


def _add_vace_config(config: dict, base_shapes: dict | None, module_shapes: dict) -> dict:
    if base_shapes is not None:
        return infer_transformer_config({**base_shapes, **module_shapes}, {"num_heads": config["num_attention_heads"]})
    num_layers = config["num_layers"]
    vace_count = len({key.split(".")[1] for key in module_shapes if key.startswith("vace_blocks.")})
    return {**config, "_class_name": "WanVACETransformer3DModel",
            "vace_layers": [i * num_layers // vace_count for i in range(vace_count)],
            "vace_in_channels": module_shapes["vace_patch_embedding.weight"][1]}


def build_transformer(model_class: type, config: dict) -> torch.nn.Module:
    """The empty (meta) transformer of a config from ``transformer_weight_source``: diffusers' class, plus the
    reference-image convolution of a Wan 2.2 Fun file (its entry is not a diffusers config key)."""
    config = dict(config)
    ref_channels = config.pop(REF_CONV_CHANNELS, None)
    model = build_empty(lambda: model_class.from_config(config))
    return model if ref_channels is None else add_reference_conv(model, ref_channels)


def load_transformer(
    path: str,
    *,
    vace_module: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "keep",
) -> torch.nn.Module:
    """A Wan T2V or VACE transformer (diffusers class) in eval mode with frozen weights; ``weights`` "keep" holds
    quantized block linears as stored (``quantized.py``), "dequantize" expands them to ``dtype``."""
    with contextlib.ExitStack() as stack:
        model_class, config, source = transformer_weight_source(path, vace_module, stack)
        model = build_transformer(model_class, config)
        model = load_weights_into(model, source, dtype=dtype, device=device, keep_quantized=weights == "keep")
        return with_native_inputs(model)



def _strip_first_matching_prefix(keys: list[str], prefixes: tuple[str, ...]) -> dict[str, str]:
    for prefix in prefixes:
        unprefixed_to_stored = strip_prefix(keys, prefix)
        if any(unprefixed != stored for unprefixed, stored in unprefixed_to_stored.items()):
            return unprefixed_to_stored
    return {key: key for key in keys}


def _vae_name_converter(unprefixed_keys) -> Callable[[dict], dict]:
    """The original-layout -> diffusers key renamer of a Wan VAE file: ours for the 2.2 layout, diffusers' for 2.1."""
    return convert_wan22_vae_keys if is_wan22_vae(unprefixed_keys) else convert_wan_vae_to_diffusers


def _original_vae_source(location: Path, stack: contextlib.ExitStack) -> tuple[dict, WeightSource]:
    """(config, weight source) of a single-file Wan 2.1 or 2.2 VAE in the original layout, maybe prefixed."""
    (checkpoint,) = open_files([location], stack)
    unprefixed_to_stored = _strip_first_matching_prefix(checkpoint.weight_keys(), VAE_PREFIXES)
    if detect_kind(unprefixed_to_stored) != "wan_vae":
        raise _wrong_kind(location, "a Wan VAE (keys encoder.*/decoder.*)", list(unprefixed_to_stored))
    shapes = {original: checkpoint.shape(stored) for original, stored in unprefixed_to_stored.items()}
    config = infer_vae_config(shapes)
    names = rename_map(unprefixed_to_stored, _vae_name_converter(unprefixed_to_stored))
    source = WeightSource({name: TensorRef(checkpoint, unprefixed_to_stored[original])
                           for name, original in names.items()}, str(location))
    return config, source


def _vae_folder_config(location: Path) -> dict:
    config = _read_folder_config(location, {"AutoencoderKLWan"}, "Wan VAE")
    if config.get("z_dim") == WAN22_LATENT_CHANNELS:
        return check_wan22_folder_config(config, location)
    return config


def load_vae(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> AutoencoderKLWan:
    """The Wan 2.1 VAE (16 latent channels, 8x spatial) or the Wan 2.2 VAE (48 channels, 16x spatial: ``vae22.py``)
    as diffusers' `AutoencoderKLWan` in eval mode with frozen weights; its config holds the factors
    (``scale_factor_spatial`` / ``scale_factor_temporal``), ``z_dim`` and the latent statistics."""
    location = resolve_model_location(path, "vae")
    with contextlib.ExitStack() as stack:
        if location.is_dir():
            config = _vae_folder_config(location)
            source = _identity_source(location, stack, DIFFUSERS_WEIGHTS_NAME)
        else:
            config, source = _original_vae_source(location, stack)
        model = build_empty(lambda: AutoencoderKLWan.from_config(config))
        return load_weights_into(model, source, dtype=dtype, device=device)
