"""LoRA files for Wan transformers: the formats users have, read as headers and named like the model; runs in both
processes (the driver checks a file's header against the model's before sampling, without model libraries; the
workers match layers and read the tensors).

Formats (one file may mix them): ComfyUI / original Wan keys (``diffusion_model.blocks.0.self_attn.q.lora_down
.weight``, ``.lora_up.weight``, ``.alpha``), PEFT / diffusers keys (``transformer.blocks.0.attn1.to_q.lora_A
.weight``, ``.lora_B.weight``), kohya flattened names (``lora_unet_blocks_0_self_attn_q.lora_down.weight``), and
full deltas ``.diff`` (weight) and ``.diff_b`` (bias). A low-rank pair adds ``strength * alpha / rank * up @ down``
to the layer's weight (alpha defaults to the rank).

Original Wan names become diffusers names with diffusers' own Wan key conversion
(``convert_wan_transformer_to_diffusers``, the one the model loader uses). diffusers' LoRA converter
(``_convert_non_diffusers_wan_lora_to_diffusers``) does not fit here: it needs every tensor in memory, bakes alpha
into the tensors, raises on VACE-block and ``.diff`` keys instead of reporting them, and cannot run in the driver.
Kohya names are flattened with ``_``, which is ambiguous (``self_attn``), so they are un-flattened by looking them
up among the model's own layer names flattened the same way.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..config import lora_strength_from_text
from .checkpoint import COMFY_TRANSFORMER_PREFIX, PICKLE_SUFFIXES, first_names, read_safetensors_header
from .detect import read_header

__all__ = ["LoraHeader", "LoraLayer", "check_lora_for_model", "read_lora_header", "parse_lora_arg"]

# Key ending -> part of a layer's LoRA. Longest endings first (".diff_b" before ".diff").
LORA_PARTS = (
    (".lora_down.weight", "down"), (".lora_A.weight", "down"), (".lora_up.weight", "up"), (".lora_B.weight", "up"),
    (".lora_B.bias", "diff_b"), (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"),
)
ORIGINAL_PREFIXES = (COMFY_TRANSFORMER_PREFIX, "diffusion_model.")
DIFFUSERS_PREFIX = "transformer."
KOHYA_PREFIX = "lora_unet_"
ORIGINAL, DIFFUSERS, KOHYA = "original", "diffusers", "kohya"
log = logging.getLogger("wanmesh.lora")


@dataclass
class LoraLayer:
    """One target layer of a LoRA file: its name as the file spells it (prefix removed) and its tensors."""

    name: str
    naming: str  # ORIGINAL, DIFFUSERS or KOHYA
    keys: dict[str, str] = field(default_factory=dict)  # part ("down", "up", "alpha", "diff", "diff_b") -> key
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def rank(self) -> int | None:
        return self.shapes["down"][0] if "down" in self.shapes else None

    def weight_delta_shape(self) -> tuple[int, int] | None:
        """(out features, in features flattened) of the weight delta, or None for a bias-only layer."""
        if "diff" in self.shapes:
            shape = self.shapes["diff"]
            return (shape[0], math.prod(shape[1:])) if len(shape) > 1 else None
        if "up" in self.shapes:
            return self.shapes["up"][0], math.prod(self.shapes["down"][1:])
        return None


@dataclass
class LoraHeader:
    """A LoRA file described from its header: target layers and the keys that are not LoRA tensors."""

    path: Path
    layers: list[LoraLayer]
    other_keys: list[str]


def _split_key(key: str) -> tuple[str, str, str] | None:
    """(naming, layer name without prefix, part) of a LoRA key, or None when it is not a LoRA tensor."""
    part = next(((ending, name) for ending, name in LORA_PARTS if key.endswith(ending)), None)
    if part is None:
        return None
    layer = key[: -len(part[0])]
    if layer.startswith(KOHYA_PREFIX):
        return KOHYA, layer[len(KOHYA_PREFIX):], part[1]
    if layer.startswith(DIFFUSERS_PREFIX):
        return DIFFUSERS, layer[len(DIFFUSERS_PREFIX):], part[1]
    for prefix in ORIGINAL_PREFIXES:
        if layer.startswith(prefix):
            return ORIGINAL, layer[len(prefix):], part[1]
    return ORIGINAL, layer, part[1]


def read_lora_header(path: str | Path) -> LoraHeader:
    """The LoRA layers of a safetensors file, checked for consistency; no tensor is read."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"LoRA file not found: {path}")
    header = read_safetensors_header(path)
    layers: dict[tuple[str, str], LoraLayer] = {}
    other = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        split = _split_key(key)
        if split is None:
            other.append(key)
            continue
        naming, name, part = split
        layer = layers.setdefault((naming, name), LoraLayer(name, naming))
        layer.keys[part], layer.shapes[part] = key, tuple(entry["shape"])
    if not layers:
        raise ValueError(f"{path.name} is not a LoRA: none of its {len(other)} keys end in lora_down/lora_up/"
                         f"lora_A/lora_B/alpha/diff/diff_b (keys: {first_names(other, 3)})")
    for layer in layers.values():
        _check_layer(path, layer)
    return LoraHeader(path, list(layers.values()), other)


def _check_layer(path: Path, layer: LoraLayer) -> None:
    has_down, has_up = "down" in layer.shapes, "up" in layer.shapes
    if has_down != has_up:
        raise ValueError(f"LoRA {path.name}: layer {layer.name} has a {'down' if has_down else 'up'} matrix but no "
                         f"{'up' if has_down else 'down'} matrix")
    if has_down:
        down, up = layer.shapes["down"], layer.shapes["up"]
        if len(up) < 2 or len(down) < 2 or math.prod(up[1:]) != down[0]:
            raise ValueError(f"LoRA {path.name}: layer {layer.name} has up {list(up)} and down {list(down)}, "
                             f"whose ranks differ (up's second dimension must equal down's first)")
    if "alpha" in layer.shapes and math.prod(layer.shapes["alpha"]) != 1:
        raise ValueError(f"LoRA {path.name}: alpha of {layer.name} has shape {list(layer.shapes['alpha'])}, "
                         f"expected one number")


# -- the driver's check before sampling ---------------------------------------------------------------------


def _model_weight_files(path: Path) -> list[Path]:
    if path.is_dir():
        folder = path / "transformer" if (path / "model_index.json").is_file() else path
        return sorted(folder.glob("*.safetensors"))
    return [] if path.suffix.lower() in PICKLE_SUFFIXES else [path]  # safetensors or GGUF: headers tell the shapes


def _layer_shapes(model_files: list[str]) -> set[tuple[int, int]] | None:
    """(out, in flattened) of every weight of at least 2 dimensions in the model files; None if unreadable here."""
    files = [f for path in model_files for f in _model_weight_files(Path(path))]
    if not files:
        return None
    shapes = set()
    for file in files:
        for key, shape in read_header(file).shapes.items():
            if len(shape) >= 2 and key.endswith(".weight"):
                shapes.add((shape[0], math.prod(shape[1:])))
    return shapes


def check_lora_for_model(lora_path: str | Path, model_files: list[str]) -> LoraHeader:
    """Headers only: the file is a LoRA and its layers have the shapes of the model's layers.

    A LoRA none of whose weight deltas has the shape of any model layer is for another model (ValueError); the
    exact per-layer match, and the report of layers that match nothing, happen on the workers.
    """
    header = read_lora_header(lora_path)
    shapes = _layer_shapes(model_files)
    deltas = [(layer.name, layer.weight_delta_shape()) for layer in header.layers]
    deltas = [(name, shape) for name, shape in deltas if shape is not None]
    if shapes is None or not deltas:
        return header
    fitting = [name for name, shape in deltas if shape in shapes]
    if not fitting:
        example = deltas[0]
        raise ValueError(f"LoRA {header.path.name} does not fit this model: no layer of the model has the shape of "
                         f"its deltas (e.g. {example[0]} is {list(example[1])}); it is for another model")
    unfit = [name for name, shape in deltas if shape not in shapes] + header.other_keys
    if unfit:
        log.warning("LoRA %s: %d keys/layers fit no layer of the model and will not be applied: %s",
                    header.path.name, len(unfit), first_names(unfit, 5))
    return header


def parse_lora_arg(text: str) -> tuple[str, float]:
    """``FILE[:STRENGTH]`` (the command line's --lora) -> (file, strength); strength 1.0 when not given."""
    path, sep, tail = text.rpartition(":")
    if not sep or os.path.exists(text) or "/" in tail or "\\" in tail:  # no strength, or a colon inside the path
        return text, 1.0
    return path, lora_strength_from_text(tail, text)

