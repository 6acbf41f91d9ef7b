"""Writing Wan transformer fp8 files in the layouts ComfyUI users have: plain fp8 (``float8_e4m3fn`` or
``float8_e5m2`` block linears) and ComfyUI's "scaled fp8"; runs in the CLI process (`wanmesh make-tiny`) and tests.

Only the block linears (the 2-D ``.weight`` tensors under ``blocks.N`` / ``vace_blocks.N``: attention q/k/v/o,
FFN, VACE projections) are stored as fp8; norms, biases, embeddings, modulation tables and the head keep the
dtype they have in the state dict given. Scaled fp8 stores each such weight as ``W / scale`` with one float32
scalar per layer under ``<layer>.scale_weight`` (scale = the layer's absolute maximum over the fp8 type's
largest value, 448 for e4m3fn) and an empty ``scaled_fp8`` marker tensor of the fp8 type at the top level.
Files are written atomically (``tensor_files.save_tensors_atomic``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..weights.checkpoint import COMFY_TRANSFORMER_PREFIX, SCALED_FP8_MARKER, scale_key_for
from ..weights.quantized import BLOCK_PREFIXES, keeps_quantized
from ..tensor_files import save_tensors_atomic

__all__ = ["fp8_state", "is_block_linear_weight", "write_fp8_file"]

def is_block_linear_weight(key: str, tensor: torch.Tensor) -> bool:
    """Whether ``key`` is the weight of a linear layer inside a transformer (or VACE) block, which fp8 files store
    as fp8 (the loader keeps these and a few other linears quantized when a file stores them so)."""
    return tensor.ndim == 2 and keeps_quantized(key.removeprefix(COMFY_TRANSFORMER_PREFIX), BLOCK_PREFIXES)


def _to_fp8(weight: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    largest = torch.finfo(fp8_dtype).max
    return weight.to(torch.float32).clamp(-largest, largest).to(fp8_dtype)


def _scaled(weight: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 W / scale, float32 scalar scale) with scale = absmax / the fp8 type's largest value."""
    absmax = weight.detach().abs().max().to(torch.float32)
    scale = absmax / torch.finfo(fp8_dtype).max if absmax > 0 else torch.tensor(1.0)
    return _to_fp8(weight.to(torch.float32) / scale, fp8_dtype), scale.reshape(())


def fp8_state(state: Mapping[str, torch.Tensor], fp8_dtype: torch.dtype, scaled: bool) -> dict[str, torch.Tensor]:
    """The tensors of an fp8 file made from ``state`` (see the module)."""
    stored: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not is_block_linear_weight(key, tensor):
            stored[key] = tensor
        elif scaled:
            stored[key], stored[scale_key_for(key)] = _scaled(tensor, fp8_dtype)
        else:
            stored[key] = _to_fp8(tensor, fp8_dtype)
    if scaled:
        stored[SCALED_FP8_MARKER] = torch.empty(0, dtype=fp8_dtype)
    return stored


def write_fp8_file(
    state: Mapping[str, torch.Tensor], path: str | Path, fp8_dtype: torch.dtype, scaled: bool,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write an original-layout Wan state dict as a plain (``scaled=False``) or ComfyUI scaled fp8 safetensors
    file of ``fp8_dtype``; ``metadata`` goes into the header (e.g. ``num_heads``)."""
    return save_tensors_atomic(fp8_state(state, fp8_dtype, scaled), path, metadata=metadata)
