"""GGUF dequantisation in torch: stored quant blocks to float values, on whatever device the blocks are on;
runs in the worker processes, where a rank expands a GGUF weight (at load, or per matmul in a linear that keeps
its stored blocks).

Hand-written because the gguf package dequantises in numpy, on the CPU only: too slow to run every step and no
use for weights that live on a GPU. The block layouts are the ones ``gguf.quants`` reads (sizes from
``gguf.GGML_QUANT_SIZES``); everything here is vectorised torch over all blocks at once, with only integer ops
CUDA has for 8-bit types (shifts, and, or, subtraction).

Every block type decodes as scale * (level - zero) - offset per block or sub-block, the level shift in integers
as gguf does it. Scales are f16 values times small integers and levels small integers, so every product is
exact in float32 (at most 24 significant bits) whatever the order, and the one rounding, applying a min, is the
same operation gguf makes (x + m and x - (-m) round alike): results equal ``gguf.quants.dequantize`` bit for
bit in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

__all__ = ["SUPPORTED_TYPES", "dequantize"]

_Q = gguf.GGMLQuantizationType
_FLOAT_DTYPES = {_Q.F32: torch.float32, _Q.F16: torch.float16, _Q.BF16: torch.bfloat16}


def dequantize(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values of `data`, whole `qtype` blocks along the last dim, as `dtype` (computed in float32).

    `data` is uint8 of shape [..., n_bytes], any rows or any block-aligned column range of a stored matrix; the
    result has shape [..., n_bytes // bytes_per_block * block_size]. Float types may also come typed (a
    float32 / float16 / bfloat16 tensor); F32 data asked for as float32 is returned without a copy.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {_name(qtype)} cannot be dequantised; supported: {supported_names()}")
    qtype = _Q(qtype)  # a plain int is accepted too
    if qtype in _FLOAT_DTYPES:
        return _float_values(data, qtype).to(dtype)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    _check_bytes(data, qtype, block_bytes)
    values = _BLOCK_DECODERS[qtype](data.reshape(-1, block_bytes))
    return values.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block_elements).to(dtype)


def _name(qtype) -> str:
    return getattr(qtype, "name", str(qtype))


def supported_names() -> str:
    """The supported GGUF type names, for error messages."""
    return ", ".join(sorted(qtype.name for qtype in SUPPORTED_TYPES))


def _check_bytes(data: torch.Tensor, qtype: gguf.GGMLQuantizationType, block_bytes: int) -> None:
    if data.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} data must be uint8 bytes, not {data.dtype}")
    if data.dim() == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"{qtype.name} data of shape {tuple(data.shape)} is not whole {block_bytes}-byte blocks "
                         "along its last dim")


def _float_values(data: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    stored = _FLOAT_DTYPES[qtype]
    if data.dtype == torch.uint8:
        _check_bytes(data, qtype, stored.itemsize)
        data = data.contiguous().view(stored)  # a view to a wider dtype needs a dense last dim
    elif data.dtype != stored:
        raise ValueError(f"{qtype.name} data must be uint8 bytes or {stored}, not {data.dtype}")
    return data.float()


# -- pieces of a block --------------------------------------------------------------------------------------


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at byte `offset` of each block, as float32 of shape [n_blocks, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _unpack(packed: torch.Tensor, bits: int, run: int) -> torch.Tensor:
    """[n, bytes] -> [n, bytes * 8 // bits] fields of `bits` bits: each run of `run` bytes gives its lowest
    fields for `run` values, then the next fields up for the next `run` values (how GGML lays out levels)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).reshape(1, 1, -1, 1)
    fields = packed.reshape(packed.shape[0], -1, 1, run) >> shifts
    return fields.bitwise_and_((1 << bits) - 1).reshape(packed.shape[0], -1)


def _affine(
    levels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None, zero: int = 0,
) -> torch.Tensor:
    """scale * (level - zero) - offset, per block or sub-block: `levels` [n, elements] of 8-bit integers,
    `scale` / `offset` float32 [n, sub_blocks]. Works in place on one float32 buffer (on the CPU a fresh large
    buffer costs more than the arithmetic); `zero` is taken off `levels`, a buffer the caller unpacked, in
    place as int8, before the float product, as gguf does (so even a zero's sign matches)."""
    if zero:
        levels = levels.view(torch.int8).sub_(zero)
    values = levels.reshape(*scale.shape, -1).float()
    values.mul_(scale.unsqueeze(-1))
    if offset is not None:
        values.sub_(offset.unsqueeze(-1))
    return values.reshape(levels.shape[0], -1)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's twelve scale bytes -> eight 6-bit scales and mins. Bytes 0-3 / 4-7 hold scales / mins
    0-3 in their low 6 bits and the top 2 bits of 4-7 above them; bytes 8-11 hold the low nibbles of 4-7."""
    low_scales, low_mins, nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 0x3F, (nibbles & 0x0F) | ((low_scales >> 2) & 0x30)], dim=1)
    mins = torch.cat([low_mins & 0x3F, (nibbles >> 4) | ((low_mins >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


# -- one decoder per type: [n_blocks, bytes_per_block] uint8 -> [n_blocks, block_size] float32 ---------------


def _q8_0(blocks):
    return _affine(blocks[:, 2:].view(torch.int8), _half(blocks, 0))


def _q4_0(blocks):
    return _affine(_unpack(blocks[:, 2:], 4, 16), _half(blocks, 0), zero=8)


def _q4_1(blocks):
    return _affine(_unpack(blocks[:, 4:], 4, 16), _half(blocks, 0), offset=-_half(blocks, 2))


def _five_bit(blocks, high_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 levels: a little-endian 32-bit word of high bits at `high_at`, then the low nibbles."""
    return _unpack(blocks[:, high_at + 4:], 4, 16) | (_unpack(blocks[:, high_at:high_at + 4], 1, 1) << 4)


def _q5_0(blocks):
    return _affine(_five_bit(blocks, 2), _half(blocks, 0), zero=16)


def _q5_1(blocks):
    return _affine(_five_bit(blocks, 4), _half(blocks, 0), offset=-_half(blocks, 2))


def _q2_k(blocks):
    scale_bytes = blocks[:, 0:16]  # low nibble: a sub-block's scale, high nibble: its min
    scales = _half(blocks, 80) * (scale_bytes & 0x0F).float()
    mins = _half(blocks, 82) * (scale_bytes >> 4).float()
    return _affine(_unpack(blocks[:, 16:80], 2, 32), scales, mins)


def _q3_k(blocks):
    scales = _unpack(blocks[:, 96:104], 4, 8) | (_unpack(blocks[:, 104:108], 2, 4) << 4)
    scales = _half(blocks, 108) * (scales.float() - 32)
    # A set bit of the high mask means no -4 offset: level = low | high << 2, minus 4.
    levels = _unpack(blocks[:, 32:96], 2, 32) | (_unpack(blocks[:, 0:32], 1, 32) << 2)
    return _affine(levels, scales, zero=4)


def _q4_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    return _affine(_unpack(blocks[:, 16:144], 4, 32), _half(blocks, 0) * scales, _half(blocks, 2) * mins)


def _q5_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    levels = _unpack(blocks[:, 48:176], 4, 32) | (_unpack(blocks[:, 16:48], 1, 32) << 4)
    return _affine(levels, _half(blocks, 0) * scales, _half(blocks, 2) * mins)


def _q6_k(blocks):
    scales = _half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()
    levels = _unpack(blocks[:, 0:128], 4, 64) | (_unpack(blocks[:, 128:192], 2, 32) << 4)
    return _affine(levels, scales, zero=32)


_BLOCK_DECODERS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _Q.Q8_0: _q8_0, _Q.Q5_0: _q5_0, _Q.Q5_1: _q5_1, _Q.Q4_0: _q4_0, _Q.Q4_1: _q4_1,
    _Q.Q6_K: _q6_k, _Q.Q5_K: _q5_k, _Q.Q4_K: _q4_k, _Q.Q3_K: _q3_k, _Q.Q2_K: _q2_k,
}
SUPPORTED_TYPES = frozenset(_FLOAT_DTYPES) | frozenset(_BLOCK_DECODERS)
