"""Merging LoRAs into a resident, possibly tensor-parallel-sharded Wan / VACE transformer and taking them out
again; runs in a worker process (every rank merges its own slices).

Each rank computes only its slice of each delta, in float32, then casts to the weight's dtype: for a
column-sharded layer (rows split) the slice of the up matrix times the whole down matrix, for a row-sharded
layer (columns split) the whole up matrix times the slice of the down matrix; full deltas (``diff``,
``diff_b``) are read as slices. Which parameter is split along which dimension comes from the model's
tensor-parallel plan (``model.tp_plan``), the one its sharded loader used.

Float weights: nothing of the base weights is kept; changing or removing LoRAs reads the touched parameters back
from the model file (memory-mapped reads of this rank's slices through the same weight source, and the same
dequantisation, as loading), so resident memory stays flat across LoRA switches. Quantized layers (fp8, scaled fp8,
GGUF kept as stored, ``models/quantized.py``) are never written: each LoRA is a parametrization after the
dequantization holding this rank's low-rank factors (``LoraBranch``), which adds the same float32 delta a merge
adds, so a quantized model with a LoRA gives the weights of its dequantized twin with the LoRA merged. Removing
LoRAs drops those branches: the layer is bit for bit what it was before.

Which LoRAs are applied is kept on the model object, so an unloaded and reloaded model starts clean.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..distributed.tensor_parallel import shard_index
from ..weights.checkpoint import COMFY_TRANSFORMER_PREFIX, CheckpointFile, first_names, rename_map
from ..weights.gguf_file import open_files
from ..weights.quantized import logical_parameters, quantized_layers
from ..config import check_lora_strength
from ..weights.lora_files import DIFFUSERS, KOHYA, LoraHeader, LoraLayer, read_lora_header

__all__ = ["LoraPatch", "LoraState", "apply_loras", "plan_lora", "applied_loras"]

log = logging.getLogger("wanmesh.lora")
STATE_ATTRIBUTE = "_wanmesh_lora_state"
UNMATCHED_SHOWN = 5


@dataclass(frozen=True)
class LoraState:
    """What is merged into a model now: the ordered (file, strength) list and the parameters it changed."""

    applied: tuple[tuple[str, float], ...] = ()
    touched: frozenset[str] = frozenset()


@dataclass
class LoraPatch:
    """One LoRA file matched against a model: model module path -> the file's layer, plus what matched nothing."""

    path: str
    strength: float
    file: CheckpointFile
    layers: dict[str, LoraLayer]
    unmatched: list[str] = field(default_factory=list)


def applied_loras(model: nn.Module) -> tuple[tuple[str, float], ...]:
    return getattr(model, STATE_ATTRIBUTE, LoraState()).applied


def normalise_loras(loras) -> tuple[tuple[str, float], ...]:
    """The protocol may bring tuples back as lists: (file, strength) tuples with a float strength, checked."""
    normalised = []
    for entry in loras or ():
        path, strength = entry
        check_lora_strength(float(strength))
        normalised.append((str(path), float(strength)))
    return tuple(normalised)


# -- matching a LoRA's layers to the model's modules --------------------------------------------------------


def _original_module_names(source) -> list[str]:
    """The original-layout module names of a single-file model (from its stored keys); empty for a diffusers folder."""
    names = []
    for ref in source.refs.values():
        key = ref.key[len(COMFY_TRANSFORMER_PREFIX):] if ref.key.startswith(COMFY_TRANSFORMER_PREFIX) else ref.key
        names.append(key.rpartition(".")[0])
    return names


def _diffusers_names(original_layers: list[str]) -> dict[str, str]:
    """Original Wan layer name -> diffusers module path, with diffusers' own Wan key conversion."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = rename_map([f"{name}.weight" for name in original_layers], convert_wan_transformer_to_diffusers)
    return {original.removesuffix(".weight"): new.removesuffix(".weight") for new, original in converted.items()}


def match_layers(header: LoraHeader, modules: set[str], original_names: list[str]) -> tuple[dict, list[str]]:
    """({model module: LoRA layer}, names of LoRA layers that match no module of the model)."""
    # Kohya flattens names with "_": look them up among the model's own names flattened the same way.
    flat = {name.replace(".", "_"): name for name in [*original_names, *modules]}
    wanted = {}
    for layer in header.layers:
        name = flat.get(layer.name, layer.name) if layer.naming == KOHYA else layer.name
        wanted[layer.name] = (name, layer.naming == DIFFUSERS or (layer.naming == KOHYA and name in modules))
    to_diffusers = _diffusers_names([name for name, is_diffusers in wanted.values() if not is_diffusers])
    matched, unmatched = {}, []
    for layer in header.layers:
        name, is_diffusers = wanted[layer.name]
        module = name if is_diffusers else to_diffusers.get(name, name)
        if module in modules:
            matched[module] = layer
        else:
            unmatched.append(layer.name)
    return matched, unmatched


# -- shapes on this rank ----------------------------------------------------------------------------------


def _shard_of(model: nn.Module, parameter_name: str) -> tuple[int | None, int, int]:
    """(split dimension or None, tp rank, tp size) of a parameter of this rank's model."""
    plan = getattr(model, "tp_plan", None)
    tp = getattr(model, "tp_size", 1)
    if plan is None or tp == 1:
        return None, 0, 1
    return plan.shard_dims().get(parameter_name), model.tp_rank, tp


def _full_shape(local: torch.Size, dim: int | None, tp: int) -> tuple[int, ...]:
    shape = list(local)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def _check_fits(patch_path: str, module: str, layer: LoraLayer, parameters: dict, model: nn.Module) -> None:
    """One-line ValueError when the layer's delta has another shape (or rank) than the model's layer."""
    name = f"{module}.weight"
    delta = layer.weight_delta_shape()
    if name in parameters and delta is not None:
        dim, _, tp = _shard_of(model, name)
        full = _full_shape(parameters[name].shape, dim, tp)
        if delta != (full[0], math.prod(full[1:])):
            found = f"up {list(layer.shapes['up'])} x down {list(layer.shapes['down'])}" if "up" in layer.shapes \
                else f"diff {list(layer.shapes['diff'])}"
            raise ValueError(f"LoRA {patch_path}: layer {layer.name} ({found}) does not fit {module} of weight shape "
                             f"{list(full)}; the LoRA is for another model or its rank/shape is wrong")
    bias = f"{module}.bias"
    if "diff_b" in layer.shapes and bias in parameters:
        dim, _, tp = _shard_of(model, bias)
        full = _full_shape(parameters[bias].shape, dim, tp)
        if tuple(layer.shapes["diff_b"]) != full:
            raise ValueError(f"LoRA {patch_path}: diff_b of {layer.name} has shape {list(layer.shapes['diff_b'])}, "
                             f"{module} has a bias of shape {list(full)}")


def plan_lora(model: nn.Module, path: str, strength: float, original_names: list[str],
              stack: contextlib.ExitStack) -> LoraPatch:
    """A LoRA file matched and shape-checked against ``model``; ValueError when nothing matches or a shape differs."""
    header = read_lora_header(path)
    parameters = logical_parameters(model)
    modules = {name.rpartition(".")[0] for name in parameters}
    matched, unmatched = match_layers(header, modules, original_names)
    if not matched:
        raise ValueError(f"LoRA {path}: none of its {len(header.layers)} layers matches a layer of this model "
                         f"(e.g. {first_names([layer.name for layer in header.layers], 3)}); it is for another model")
    for module, layer in matched.items():
        _check_fits(path, module, layer, parameters, model)
    (file,) = open_files([path], stack)
    return LoraPatch(path, strength, file, matched, unmatched + header.other_keys)


# -- merging -----------------------------------------------------------------------------------------------


def _read(file: CheckpointFile, key: str, index=None) -> torch.Tensor:
    return file.raw(key, index).to(torch.float32)


@dataclass(frozen=True)
class WeightFactors:
    """This rank's part of a layer's weight delta (float32, unscaled by strength): up x down x factor, or a
    full ``diff`` (then ``down`` is None)."""

    up: torch.Tensor
    down: torch.Tensor | None
    factor: float = 1.0

    def delta(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        if self.down is None:
            return self.up.reshape(shape)
        return (self.up @ self.down).reshape(shape) * self.factor

    def to(self, device: torch.device) -> WeightFactors:
        down = None if self.down is None else self.down.to(device)
        return WeightFactors(self.up.to(device), down, self.factor)


def _weight_factors(patch: LoraPatch, layer: LoraLayer, dim: int | None, rank: int, tp: int) -> WeightFactors:
    """This rank's slices of the layer's factors (or of its full diff)."""
    if "diff" in layer.keys:
        diff_shape = layer.shapes["diff"]
        index = None if dim is None else shard_index(diff_shape, dim, rank, tp)
        return WeightFactors(_read(patch.file, layer.keys["diff"], index), None)
    alpha = _read(patch.file, layer.keys["alpha"]).item() if "alpha" in layer.keys else layer.rank
    up_index = shard_index(layer.shapes["up"], 0, rank, tp) if dim == 0 else None
    down_index = shard_index(layer.shapes["down"], 1, rank, tp) if dim == 1 else None
    up = _read(patch.file, layer.keys["up"], up_index)
    down = _read(patch.file, layer.keys["down"], down_index)
    return WeightFactors(up.reshape(up.shape[0], layer.rank), down.reshape(layer.rank, -1), alpha / layer.rank)


class LoraBranch(nn.Module):
    """A parametrization after a quantized layer's dequantization: weight + strength x delta, added in float32
    and cast back, the same arithmetic as ``merge_patch`` on a float weight."""

    def __init__(self, factors: WeightFactors, strength: float, shape: tuple[int, ...]):
        super().__init__()
        self.factors, self.strength, self.shape = factors, strength, tuple(shape)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return (weight.to(torch.float32) + self.strength * self.factors.delta(self.shape)).to(weight.dtype)


def _bias_delta(patch: LoraPatch, layer: LoraLayer, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    index = None if dim is None else shard_index(layer.shapes["diff_b"], dim, rank, tp)
    return _read(patch.file, layer.keys["diff_b"], index)


def _layer_deltas(layer: LoraLayer, module: str) -> list[tuple[str, str]]:
    """(parameter name, "weight" or "bias") of each delta the layer brings."""
    # a full diff of a 1-D weight (a norm's) has no (out, in) shape but is a weight delta all the same
    has_weight = layer.weight_delta_shape() is not None or "diff" in layer.keys
    deltas = [(f"{module}.weight", "weight")] if has_weight else []
    return deltas + ([(f"{module}.bias", "bias")] if "diff_b" in layer.keys else [])


@torch.no_grad()
def merge_patch(model: nn.Module, patch: LoraPatch) -> set[str]:
    """Add ``strength x`` each layer's delta (this rank's slice, float32, then cast) to the weights; the names changed."""
    if patch.strength == 0:
        return set()  # strength 0 leaves the weights exactly as they are
    parameters = logical_parameters(model)
    quantized = quantized_layers(model)
    changed = set()
    for module, layer in patch.layers.items():
        for name, kind in _layer_deltas(layer, module):
            if name not in parameters:
                continue
            parameter = parameters[name]
            dim, rank, tp = _shard_of(model, name)
            if kind == "weight" and module in quantized:
                layer_weights = quantized[module].parametrizations.weight  # its device, read without dequantizing
                factors = _weight_factors(patch, layer, dim, rank, tp).to(layer_weights.original.device)
                # unsafe: skips a trial dequantization; a LoRA branch keeps the weight's shape and dtype
                parametrize.register_parametrization(quantized[module], "weight",
                                                     LoraBranch(factors, patch.strength, parameter.shape), unsafe=True)
            else:
                delta = _weight_factors(patch, layer, dim, rank, tp).delta(parameter.shape) if kind == "weight" \
                    else _bias_delta(patch, layer, dim, rank, tp)
                merged = parameter.detach().to(torch.float32) + patch.strength * delta.to(parameter.device)
                parameter.data.copy_(merged.to(parameter.dtype))
            changed.add(name)
    return changed


@torch.no_grad()
def restore_base(model: nn.Module, names: set[str], source) -> None:
    """Read the named float parameters back from the model file (this rank's slices), as loading did; drop the
    LoRA branches of quantized layers (their stored weights were never written)."""
    parameters = dict(model.named_parameters())
    quantized = quantized_layers(model)
    for name in sorted(names):
        module_path, _, kind = name.rpartition(".")
        if kind == "weight" and module_path in quantized:
            branches = quantized[module_path].parametrizations.weight
            while len(branches) > 1:  # the first is the dequantization; every later one is a LoRA
                del branches[-1]
            continue
        parameter = parameters[name]
        parameter.data.copy_(source.read(name, parameter.dtype).to(parameter.device))


def _rank_source(model: nn.Module, source):
    """The weight source answering with this rank's slices (what the sharded loader read)."""
    plan, tp = getattr(model, "tp_plan", None), getattr(model, "tp_size", 1)
    if plan is None or tp == 1:
        return source
    from ..weights.sharded import ShardedWeightSource

    return ShardedWeightSource(source, plan.shard_dims(), model.tp_rank, tp)


def apply_loras(model: nn.Module, loras, *, path: str, vace_module: str | None = None) -> LoraState:
    """Make ``loras`` (ordered (file, strength) pairs) the LoRAs merged into ``model``, doing only the difference.

    Every file is matched and checked before any weight changes. Appending LoRAs merges just the new ones;
    any other change first restores the parameters the old list touched from the model file."""
    from ..weights.loaders import transformer_weight_source

    wanted = normalise_loras(loras)
    state: LoraState = getattr(model, STATE_ATTRIBUTE, LoraState())
    if wanted == state.applied:
        return state
    with contextlib.ExitStack() as stack:
        _, _, source = transformer_weight_source(path, vace_module, stack)
        originals = _original_module_names(source)
        keep = len(state.applied) if wanted[: len(state.applied)] == state.applied else 0
        patches = [plan_lora(model, file, strength, originals, stack) for file, strength in wanted[keep:]]
        for patch in patches:
            _report_unmatched(patch)
        touched = set(state.touched) if keep else set()
        if not keep and state.touched:
            restore_base(model, set(state.touched), _rank_source(model, source))
        try:
            for patch in patches:
                touched |= merge_patch(model, patch)
        except BaseException:
            restore_base(model, touched | set(state.touched), _rank_source(model, source))
            setattr(model, STATE_ATTRIBUTE, LoraState())
            raise
    new_state = LoraState(wanted, frozenset(touched))
    setattr(model, STATE_ATTRIBUTE, new_state)
    return new_state


def _report_unmatched(patch: LoraPatch) -> None:
    if patch.unmatched:
        log.warning("LoRA %s: %d keys/layers match nothing in the model and are not applied: %s", patch.path,
                    len(patch.unmatched), first_names(patch.unmatched, UNMATCHED_SHOWN))
