"""Quantized linear weights held as stored on each rank; runs in the worker processes.

A transformer or VACE block linear (attention q/k/v/out, the FFN), or the modulation or text projection, whose
file stores it quantized (fp8 and ComfyUI "scaled fp8": fp8 values times one float32 ``scale_weight`` per layer;
GGUF: quant blocks) keeps those bytes as a parameter. A parametrization on the layer's ``weight`` (``torch.nn.utils.parametrize``) dequantizes them to the
compute dtype each time the layer reads its weight, so the full-precision weight lives only for its own matmul, as
ComfyUI's cast-on-the-fly ops and the ComfyUI GGUF loader do. The stored tensor sits under
``<module>.parametrizations.weight.original``; ``nn.Linear``, the tensor-parallel linears and diffusers' attention
processors read ``.weight`` and run unchanged.

The same holds a bf16 / fp16 file's linears when the compute dtype is wider (float32, the CPU's): they stay in the
file's dtype and are widened for each matmul, as ComfyUI's manual-cast ops run such files, so a rank holds the
file's bytes, not twice them. Norms, biases, the patch and time embedders, modulation tables and the head are small
and stay float. A LoRA on a quantized layer is
another parametrization after the dequantization (``lora_merge.py``): the stored bytes are never written.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["FP8", "NARROW_FLOAT", "Dequantize", "StoredTensor", "dequantize_stored", "hold_stored_", "is_quantized_layer",
           "keeps_quantized", "logical_name", "logical_parameters", "logical_weight", "quantized_layers",
           "read_weights"]

FP8 = "fp8"  # the qtype of fp8 values (e4m3fn, e5m2), with or without a scale; GGUF tensors use gguf's type enum
NARROW_FLOAT = "narrow float"  # the qtype of bf16 / fp16 values computed in a wider dtype (float32 on the CPU)
# The linears that may stay quantized, by diffusers and original (file) names: the transformer and VACE blocks (nearly
# all of a Wan transformer's bytes), the timestep modulation projection (6 x dim x dim) and the text projection.
# The time embedder stays float: diffusers casts the timestep to the dtype of its first parameter.
BLOCK_PREFIXES = ("blocks.", "vace_blocks.")
QUANTIZED_PREFIXES = BLOCK_PREFIXES + ("condition_embedder.time_proj.", "time_projection.",
                                       "condition_embedder.text_embedder.", "text_embedding.")


@dataclass(frozen=True)
class StoredTensor:
    """One weight (or this rank's slice of it) as the file stores it, with what dequantizing it needs."""

    data: torch.Tensor  # fp8 values of the logical shape, or uint8 GGUF blocks [rows, row bytes]
    qtype: object  # FP8, or a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the logical (dequantized) shape
    scale: torch.Tensor | None = None  # scaled fp8: the layer's float32 scale_weight
    owned: bool = False  # data is a private copy (not a view of a mapped file): held as it is, not copied again


def dequantize_stored(data: torch.Tensor, qtype, shape: tuple[int, ...], dtype: torch.dtype,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight of stored ``data``, in ``dtype``: fp8 times its scale (in ``dtype``), or GGUF blocks decoded.

    The one dequantization used at load ("dequantize") and per matmul ("keep"), so both give the same weights."""
    if qtype == NARROW_FLOAT:  # exact: every bf16 / fp16 value is a float32 value
        return data.to(dtype)
    if qtype == FP8:
        values = fp8_values(data, dtype)
        if scale is not None:  # one scalar per layer: real weight = fp8 weight x scale_weight, in the compute
            values *= scale.to(device=values.device, dtype=dtype)  # dtype, as ComfyUI's scaled fp8 ops do
        return values
    from .dequant import dequantize

    return dequantize(data, qtype, dtype).reshape(shape)


def fp8_values(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values in ``dtype``, exactly (every fp8 value is a float16, bfloat16 and float32 value). On the CPU
    through a table of all 256 fp8 values (``index_select``): torch's elementwise fp8 cast there is about twice
    as slow, and a kept fp8 layer pays it at every matmul. The table is torch's own cast of each byte."""
    if data.device.type != "cpu":
        return data.to(dtype)
    indices = data.view(torch.uint8).reshape(-1).to(torch.int32)
    return _fp8_table(data.dtype, dtype).index_select(0, indices).view(data.shape)


@functools.cache
def _fp8_table(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(fp8_dtype).to(dtype)


class Dequantize(nn.Module):
    """The parametrization of a quantized layer's ``weight``: stored tensor in, float weight out."""

    def __init__(self, qtype, shape: tuple[int, ...], dtype: torch.dtype, scale: torch.Tensor | None = None):
        super().__init__()
        self.qtype, self.shape, self.dtype = qtype, tuple(shape), dtype
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        return dequantize_stored(stored, self.qtype, self.shape, self.dtype, self.scale)

    def extra_repr(self) -> str:
        name = self.qtype if isinstance(self.qtype, str) else self.qtype.name
        return f"{name}, shape={list(self.shape)}, dtype={self.dtype}"


def keeps_quantized(name: str, prefixes: tuple[str, ...] = QUANTIZED_PREFIXES) -> bool:
    """Whether parameter ``name`` may stay quantized: the weight of a linear under ``prefixes`` (its stored form
    decides whether it is quantized)."""
    return name.startswith(prefixes) and name.endswith(".weight") and ".norm" not in name


def hold_stored_(module: nn.Module, stored: StoredTensor, dtype: torch.dtype, device: str | torch.device) -> None:
    """Make ``module.weight`` the stored tensor on ``device``, dequantized to ``dtype`` whenever it is read."""
    # A view of a mapped file is copied (the model must not keep the file's pages); a private copy is moved as is
    module.weight = nn.Parameter(stored.data.to(device, copy=not stored.owned), requires_grad=False)
    scale = None if stored.scale is None else stored.scale.to(device=device, dtype=torch.float32, copy=True)
    parametrize.register_parametrization(module, "weight", Dequantize(stored.qtype, stored.shape, dtype, scale),
                                         unsafe=True)  # unsafe: the stored tensor's shape and dtype differ on purpose


def logical_name(parameter_name: str) -> str:
    """A parameter's name as its layer reads it: a quantized layer's stored tensor is its ``weight``."""
    return parameter_name.replace(".parametrizations.weight.original", ".weight")


def is_quantized_layer(module: nn.Module) -> bool:
    return parametrize.is_parametrized(module, "weight") and isinstance(module.parametrizations.weight[0], Dequantize)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module path: module} of the layers holding a stored quantized weight."""
    return {name: module for name, module in model.named_modules() if is_quantized_layer(module)}


def logical_weight(module: nn.Module) -> torch.Tensor:
    """A stand-in with the shape and dtype the layer's ``weight`` has when read (meta for a quantized layer, so
    looking at shapes dequantizes nothing)."""
    if is_quantized_layer(module):
        dequantize = module.parametrizations.weight[0]
        return torch.empty(dequantize.shape, dtype=dequantize.dtype, device="meta")
    return module.weight


def _by_logical_names(model: nn.Module, entries, weight_of) -> dict[str, torch.Tensor]:
    """``entries`` ((name, tensor) of ``model``) without the stored tensors of its quantized layers, and
    ``<layer>.weight`` = ``weight_of(layer)`` for each of those layers instead."""
    named = {name: tensor for name, tensor in entries if ".parametrizations." not in name}
    named.update({f"{path}.weight": weight_of(module) for path, module in quantized_layers(model).items()})
    return named


def logical_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by the names and shapes its layers read them: a quantized layer's weight appears as
    ``<module>.weight`` (a meta stand-in of its dequantized shape), not as its stored tensor."""
    return _by_logical_names(model, model.named_parameters(), logical_weight)


@torch.no_grad()
def read_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its logical name, as the layers read it (quantized weights dequantized, LoRA
    branches applied): what ``state_dict()`` would hold had the model been loaded in float."""
    return _by_logical_names(model, model.state_dict().items(), lambda module: module.weight)
