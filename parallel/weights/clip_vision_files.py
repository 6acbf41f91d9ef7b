"""The CLIP vision image encoder that Wan 2.1 image-to-video conditions on (ComfyUI's ``clip_vision_h.safetensors``,
OpenCLIP ViT-H/14): reading a single file; runs in the ComfyUI process (the CLIP vision nodes) or the CLI. Encoding is
``networks/clip_vision.py``.

The file is read as the other loaders read theirs (``checkpoint.WeightSource``: a name map, config inferred from
shapes, the model built empty and every tensor read once) into transformers' ``CLIPVisionModelWithProjection``.
Two key layouts load, as ComfyUI's ``comfy/clip_vision.py`` accepts them: transformers' CLIP naming
(``vision_model.*``, ``visual_projection.weight``; the released clip_vision_h file) and OpenCLIP's (``visual.*``,
whose fused q/k/v rows and transposed projection are read as slices and a transpose, as ComfyUI's
``convert_to_transformers`` turns them). Other keys of a file (a full CLIP's text tower) are ignored, as ComfyUI
ignores them. The outputs are ComfyUI's CLIP_VISION_OUTPUT fields (``ClipVisionOutput``); Wan reads
``penultimate_hidden_states``, [N, 257, 1280] for ViT-H at 224 px.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from .checkpoint import CheckpointFile, ModelFileError, TensorRef, WeightSource, build_empty, load_weights_into, \
    read_tensor
from .detect import _block_count, _require, describe_kind, detect_kind
from .gguf_file import open_files

__all__ = ["clip_head_count", "clip_vision_names", "infer_clip_vision_config", "load_clip_vision"]

CLIP_LAYER_NORM_EPS = 1e-5  # every CLIP vision config of ComfyUI's; its LayerNorms use torch's default, the same


# Head count without a ``num_heads`` metadata entry: 16 heads for widths from 1024 up (ViT-L/14 1024 = 16 x 64,
# ViT-H/14 1280 = 16 x 80, ViT-bigG/14 1664 = 16 x 104, as OpenCLIP and ComfyUI's configs have them), heads of 64
# below (ViT-B 768 = 12 x 64).
WIDE_CLIP_WIDTH = 1024


WIDE_CLIP_HEADS = 16


NARROW_CLIP_HEAD_DIM = 64


# OpenAI's ViT-L/14 (1024 wide, 24 layers) uses quick_gelu (ComfyUI's clip_vision_config_vitl*.json); OpenCLIP's
# ViT-H/14 and ViT-bigG/14 use exact gelu (clip_vision_config_h.json, _g.json). A ``hidden_act`` metadata entry wins.
QUICK_GELU_SHAPE = (1024, 24)


PREFIX = "vision_model."


PROJECTION = "visual_projection.weight"


IGNORED_KEYS = {"vision_model.embeddings.position_ids"}  # a buffer some transformers versions saved


OPENCLIP_PREFIX = "visual."


OPENCLIP_MARKER = "visual.transformer.resblocks.0.attn.in_proj_weight"  # what ComfyUI's load() looks for


OPENCLIP_NAMES = {
    "class_embedding": "embeddings.class_embedding", "conv1.weight": "embeddings.patch_embedding.weight",
    "positional_embedding": "embeddings.position_embedding.weight",
    "ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias",
    "ln_post.weight": "post_layernorm.weight", "ln_post.bias": "post_layernorm.bias",
}


OPENCLIP_BLOCK_NAMES = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                        "attn.out_proj": "self_attn.out_proj"}


QKV = ("q_proj", "k_proj", "v_proj")


EXPECTED = "a CLIP vision encoder such as clip_vision_h.safetensors (keys vision_model.* or visual.*)"


@dataclass(frozen=True)
class StoredPart:
    """Where a model tensor is stored: the key, a third of its rows (OpenCLIP's fused q/k/v) or its transpose."""

    key: str
    third: int | None = None
    transposed: bool = False

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        if self.third is not None:
            return (stored[0] // 3, *stored[1:])
        return tuple(reversed(stored)) if self.transposed else tuple(stored)


def _openclip_block_names(keys: set[str], block: str) -> dict[str, StoredPart]:
    source, target = f"{OPENCLIP_PREFIX}transformer.resblocks.{block}.", f"{PREFIX}encoder.layers.{block}."
    names = {}
    for old, new in OPENCLIP_BLOCK_NAMES.items():
        for suffix in ("weight", "bias"):
            if f"{source}{old}.{suffix}" in keys:
                names[f"{target}{new}.{suffix}"] = StoredPart(f"{source}{old}.{suffix}")
    for suffix in ("weight", "bias"):
        fused = f"{source}attn.in_proj_{suffix}"
        if fused in keys:
            names.update({f"{target}self_attn.{proj}.{suffix}": StoredPart(fused, third=index)
                          for index, proj in enumerate(QKV)})
    return names


def _openclip_names(keys: set[str]) -> dict[str, StoredPart]:
    """OpenCLIP ``visual.*`` keys in transformers' names, as ComfyUI's ``convert_to_transformers`` renames them;
    a ``visual.*`` key it has no name for is kept under its own name (and then refused as unexpected)."""
    names = {f"{PREFIX}{new}": StoredPart(f"{OPENCLIP_PREFIX}{old}") for old, new in OPENCLIP_NAMES.items()
             if f"{OPENCLIP_PREFIX}{old}" in keys}
    if f"{OPENCLIP_PREFIX}proj" in keys:
        names[PROJECTION] = StoredPart(f"{OPENCLIP_PREFIX}proj", transposed=True)
    blocks = {key.split(".")[3] for key in keys if key.startswith(f"{OPENCLIP_PREFIX}transformer.resblocks.")}
    for block in blocks:
        names.update(_openclip_block_names(keys, block))
    used = {part.key for part in names.values()}
    names.update({key: StoredPart(key) for key in keys if key.startswith(OPENCLIP_PREFIX) and key not in used})
    return names


def clip_vision_names(keys) -> dict[str, StoredPart]:
    """{transformers ``CLIPVisionModelWithProjection`` name: where it is stored} for a file's keys, in either
    layout; keys outside the vision tower (a text tower, ``logit_scale``) are left out."""
    keys = set(keys)
    if OPENCLIP_MARKER in keys:
        return _openclip_names(keys)
    return {key: StoredPart(key) for key in keys
            if (key.startswith(PREFIX) or key == PROJECTION) and key not in IGNORED_KEYS}


class ClipWeightSource(WeightSource):
    """A ``WeightSource`` whose tensors may be a third of a stored tensor's rows or a stored tensor transposed."""

    def __init__(self, checkpoint: CheckpointFile, parts: Mapping[str, StoredPart]):
        super().__init__({name: TensorRef(checkpoint, part.key) for name, part in parts.items()}, str(checkpoint.path))
        self.parts = dict(parts)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.parts[name].shape(super().shape(name))

    def read(self, name: str, dtype: torch.dtype, index=None) -> torch.Tensor:
        ref, part = self.refs[name], self.parts[name]
        rows = None
        if part.third is not None:
            size = ref.file.shape(ref.key)[0] // 3
            rows = slice(part.third * size, (part.third + 1) * size)
        tensor = read_tensor(ref.file, ref.key, dtype, rows)
        tensor = tensor.t().contiguous() if part.transposed else tensor
        return tensor if index is None else tensor[index]

    def is_quantized(self, name: str) -> bool:
        return False  # read through ``read`` (dequantized), never held as stored


def clip_head_count(width: int, metadata: Mapping[str, str] | None = None) -> int:
    """The attention head count: ``num_heads`` from the file's metadata, else 16 from width 1024 up and heads of 64
    below (``WIDE_CLIP_WIDTH``); 16 heads of 80 for ViT-H/14's 1280."""
    if metadata and "num_heads" in metadata:
        heads = int(metadata["num_heads"])
    else:
        heads = WIDE_CLIP_HEADS if width >= WIDE_CLIP_WIDTH else width // NARROW_CLIP_HEAD_DIM
    if heads <= 0 or width % heads:
        raise ModelFileError(f"CLIP vision: {heads} attention heads do not divide the width {width}; set the file's "
                             f"num_heads metadata to a divisor of {width}.")
    return heads


def _image_size(positions: int, patch: int) -> int:
    side = math.isqrt(max(positions - 1, 0))
    if side * side != positions - 1:
        raise ModelFileError(f"CLIP vision: {positions} position embeddings are not a class token plus a square grid "
                             f"of patches (1 + n x n, e.g. 257 for 224 px in patches of 14).")
    return side * patch


def infer_clip_vision_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str] | None = None) -> dict:
    """transformers ``CLIPVisionConfig`` kwargs from shapes in transformers' names (``clip_vision_names``): width,
    layers, MLP size and patch size from the tensors, the image size from the position count (1 + (size /
    patch)^2), heads by ``clip_head_count``, the activation as ComfyUI's configs have it (``QUICK_GELU_SHAPE``)."""
    if f"{PREFIX}embeddings.class_embedding" not in shapes:
        raise ModelFileError("CLIP vision: no class embedding (vision_model.embeddings.class_embedding): SigLIP and "
                             "other encoders without a class token are not supported; use a CLIP ViT such as "
                             "clip_vision_h.safetensors.")
    width, channels, patch, _ = _require(shapes, f"{PREFIX}embeddings.patch_embedding.weight", "patch size")
    positions = _require(shapes, f"{PREFIX}embeddings.position_embedding.weight", "image size")[0]
    layers = _block_count(shapes, f"{PREFIX}encoder.layers.")
    if layers < 2:
        raise ModelFileError(f"CLIP vision: {layers} encoder layers found (vision_model.encoder.layers.N.*); the "
                             f"penultimate layer's tokens need at least 2.")
    default_act = "quick_gelu" if (width, layers) == QUICK_GELU_SHAPE else "gelu"
    heads = clip_head_count(width, metadata)
    return {
        "hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads, "num_channels": channels,
        "intermediate_size": _require(shapes, f"{PREFIX}encoder.layers.0.mlp.fc1.weight", "MLP size")[0],
        "patch_size": patch, "image_size": _image_size(positions, patch),
        "hidden_act": (metadata or {}).get("hidden_act", default_act), "layer_norm_eps": CLIP_LAYER_NORM_EPS,
        "projection_dim": shapes[PROJECTION][0] if PROJECTION in shapes else width,
        "attention_dropout": 0.0, "dropout": 0.0,
    }


def _open_clip_vision(path: str | Path, stack: contextlib.ExitStack) -> CheckpointFile:
    location = Path(path)
    if location.is_dir():
        raise ModelFileError(f"{location}: a folder; expected {EXPECTED} as a single .safetensors file.")
    (checkpoint,) = open_files([location], stack)
    keys = checkpoint.weight_keys()
    if detect_kind(keys) != "clip_vision":
        raise ModelFileError(f"{location}: expected {EXPECTED}, but this looks like {describe_kind(keys)}.")
    return checkpoint


def load_clip_vision(path: str | Path, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> CLIPVisionModelWithProjection:
    """A CLIP vision encoder file (either key layout) as transformers' ``CLIPVisionModelWithProjection`` in eval
    mode with frozen weights; a file without a projection gets an identity one (ComfyUI's image_embeds are then the
    post-LayerNormed class token). Raises ``ModelFileError`` (one line) for anything else."""
    with contextlib.ExitStack() as stack:
        checkpoint = _open_clip_vision(path, stack)
        source = ClipWeightSource(checkpoint, clip_vision_names(checkpoint.weight_keys()))
        config = infer_clip_vision_config({name: source.shape(name) for name in source.names()}, checkpoint.metadata)
        model = build_empty(lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(**config)))
        if PROJECTION not in source.refs:
            model.visual_projection = torch.nn.Identity()
        return load_weights_into(model, source, dtype=dtype, device=device)

