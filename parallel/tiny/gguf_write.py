"""Writing Wan transformer GGUF files in the layout ComfyUI users have (original Wan key names,
``general.architecture`` "wan"); runs in the CLI process (`wanmesh make-tiny`, `wanmesh bench real-size`) and tests.

Per-tensor types follow what the usual converters do: one-dimensional, very small (<= 1024 elements) and
``modulation`` tensors stay F32, the 5-D patch embedding stays F32 (it is added unquantised after
quantisation), and a matrix whose input dimension is not a whole number of the type's quant blocks falls back
to F16. Tensors are written with ``gguf.GGUFWriter``. The gguf package dequantises every type but quantises
only the float and legacy block types (Q8_0, Q5_x, Q4_x; llama.cpp's K-type quantisers are C++), so the K types
Q6_K, Q5_K, Q4_K, Q3_K and Q2_K are packed here by hand, with plain min/max or absmax fits rather than
llama.cpp's error-minimising searches: good enough for test files, which need only read back close to what
was written. The tests check them against gguf's dequantiser.
Tensors are written one at a time (``write_wan_gguf_streamed``: the header, which lists every tensor's type
and size, is written first from the shapes), so a file larger than memory can be written.
Files are written atomically (``video_io.written_atomically``, as the project's other outputs are).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from ..weights.gguf_file import HEAD_COUNT_FIELD, WAN_ARCHITECTURE, block_size
from ..video_io import written_atomically

__all__ = ["gguf_storage_type", "quantize", "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k",
           "quantize_q6_k", "write_wan_gguf", "write_wan_gguf_streamed"]

SMALL_TENSOR_ELEMENTS = 1024
MAX_QUANTISED_DIMS = 4
_Q = gguf.GGMLQuantizationType
_FILE_TYPES = {_Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, _Q.F16: gguf.LlamaFileType.MOSTLY_F16,
               _Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K, _Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
               _Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M, _Q.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_M,
               _Q.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K}


def gguf_storage_type(key: str, shape: tuple[int, ...], target: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The type a converter stores tensor `key` of `shape` as, when the file's type is `target`."""
    elements = int(np.prod(shape))
    if len(shape) == 1 or elements <= SMALL_TENSOR_ELEMENTS or "modulation" in key or len(shape) > MAX_QUANTISED_DIMS:
        return _Q.F32
    if shape[-1] % block_size(target):
        return _Q.F16
    return target


def quantize(array: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """`array` (float32) stored as `tensor_type`: the K types by this module's quantisers, others by gguf's."""
    if tensor_type in _K_QUANTISERS:
        return _K_QUANTISERS[tensor_type](array)
    return gguf.quants.quantize(array, tensor_type)


# -- K types: 256-element blocks of sub-blocks, each with its own scale (and min) on a per-block f16 unit -----
# Each takes rows of whole 256-element blocks and returns uint8 of shape (..., blocks x bytes per block).


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16, element d * scale_j * (q - 32) with int8 scales and 6-bit q."""
    d, scales, levels = _absmax_fit(array, sub_blocks=16, bits=6, scale_max=127)
    stored = (levels + 32).astype(np.uint8)
    return _blocks(array, _pack_bits(stored & 0x0F, 4, 64), _pack_bits(stored >> 4, 2, 32),
                   scales.astype(np.int8).view(np.uint8), _f16_bytes(d))


def quantize_q5_k(array: np.ndarray) -> np.ndarray:
    """Q5_K: Q4_K's layout with a fifth bit per level, stored as its own bit plane before the nibbles."""
    d, dmin, scales, mins, levels = _min_max_fit(array, sub_blocks=8, levels=31, scale_max=63)
    return _blocks(array, _f16_bytes(d), _f16_bytes(dmin), _pack_scales(scales, mins),
                   _pack_bits(levels >> 4, 1, 32), _pack_bits(levels & 0x0F, 4, 32))


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32, element d * scale_j * q - dmin * min_j with 6-bit scales and mins, 4-bit q."""
    d, dmin, scales, mins, levels = _min_max_fit(array, sub_blocks=8, levels=15, scale_max=63)
    return _blocks(array, _f16_bytes(d), _f16_bytes(dmin), _pack_scales(scales, mins), _pack_bits(levels, 4, 32))


def quantize_q3_k(array: np.ndarray) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16, element d * scale_j * q with signed 6-bit scales and q in -4..3, stored as
    a bit plane (set: no -4 offset) and 2-bit low levels; the scales as low nibbles then top 2 bits."""
    d, scales, levels = _absmax_fit(array, sub_blocks=16, bits=3, scale_max=31)
    stored, stored_scales = (levels + 4).astype(np.uint8), (scales + 32).astype(np.uint8)
    return _blocks(array, _pack_bits(stored >> 2, 1, 32), _pack_bits(stored & 0x03, 2, 32),
                   _pack_bits(stored_scales & 0x0F, 4, 8), _pack_bits(stored_scales >> 4, 2, 4), _f16_bytes(d))


def quantize_q2_k(array: np.ndarray) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, element d * scale_j * q - dmin * min_j with 4-bit scales and mins (one
    byte per sub-block, scale in the low nibble) and 2-bit q."""
    d, dmin, scales, mins, levels = _min_max_fit(array, sub_blocks=16, levels=3, scale_max=15)
    return _blocks(array, scales | (mins << 4), _pack_bits(levels, 2, 32), _f16_bytes(d), _f16_bytes(dmin))


_K_QUANTISERS = {_Q.Q6_K: quantize_q6_k, _Q.Q5_K: quantize_q5_k, _Q.Q4_K: quantize_q4_k,
                 _Q.Q3_K: quantize_q3_k, _Q.Q2_K: quantize_q2_k}


def _min_max_fit(array: np.ndarray, sub_blocks: int, levels: int, scale_max: int):
    """Plain min/max fit of d * scale_j * q - dmin * min_j (not llama.cpp's error-minimising search: enough
    for test files). Returns f16 d and dmin per block, uint8 scales and mins per sub-block, uint8 levels."""
    rows = _sub_blocks(array, sub_blocks)
    sub_min = np.maximum(-rows.min(axis=-1), 0.0)  # dequantised values are d*sc*q - dmin*m with m >= 0
    sub_scale = (rows.max(axis=-1) + sub_min) / levels
    d = (sub_scale.max(axis=-1) / scale_max).astype(np.float16)
    dmin = (sub_min.max(axis=-1) / scale_max).astype(np.float16)
    scales = _round_in(sub_scale, d.astype(np.float32)[:, None], 0, scale_max)
    mins = _round_in(sub_min, dmin.astype(np.float32)[:, None], 0, scale_max)
    step = d.astype(np.float32)[:, None] * scales
    offset = dmin.astype(np.float32)[:, None] * mins
    quantised = _round_in(rows + offset[..., None], step[..., None], 0, levels)
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8), quantised.astype(np.uint8)


def _absmax_fit(array: np.ndarray, sub_blocks: int, bits: int, scale_max: int):
    """Symmetric fit of d * scale_j * q, q in -2^(bits-1) .. 2^(bits-1)-1, signed scales up to `scale_max`.
    Returns f16 d per block, int scales per sub-block, int levels."""
    rows = _sub_blocks(array, sub_blocks)
    lowest = 1 << (bits - 1)
    # The sub-block's value of largest magnitude maps to level -lowest (the scale takes its sign), so the
    # one extra negative level is used rather than clipped.
    peak = np.take_along_axis(rows, np.abs(rows).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    sub_scale = peak / -lowest
    d = (np.abs(sub_scale).max(axis=-1) / scale_max).astype(np.float16)
    scales = _round_in(sub_scale, d.astype(np.float32)[:, None], -scale_max, scale_max)
    step = d.astype(np.float32)[:, None] * scales
    return d, scales.astype(np.int32), _round_in(rows, step[..., None], -lowest, lowest - 1).astype(np.int32)


def _sub_blocks(array: np.ndarray, sub_blocks: int) -> np.ndarray:
    return array.astype(np.float32).reshape(-1, sub_blocks, gguf.QK_K // sub_blocks)


def _round_in(values: np.ndarray, unit: np.ndarray, low: int, high: int) -> np.ndarray:
    """values / unit rounded to whole numbers in [low, high]; 0 where the unit is 0."""
    ratio = np.divide(values, unit, out=np.zeros(np.broadcast_shapes(values.shape, unit.shape), np.float32),
                      where=unit != 0)
    return np.clip(np.rint(ratio), low, high)


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's twelve bytes: low 6 bits of scales/mins 0-3, high 2 bits of 4-7 on top, then 4-7's low
    nibbles."""
    low_scales = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    low_mins = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    nibbles = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low_scales, low_mins, nibbles], axis=1).astype(np.uint8)


def _pack_bits(values: np.ndarray, bits: int, run: int) -> np.ndarray:
    """Fields of `bits` bits into bytes, GGML's order: each run of `run` bytes holds `run` values in its lowest
    bits, the next `run` values in the bits above, and so on. `values` uint8 of shape (blocks, ...)."""
    fields = values.reshape(values.shape[0], -1, 8 // bits, run).astype(np.uint8)
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    return np.bitwise_or.reduce(fields << shifts, axis=2).reshape(values.shape[0], -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _blocks(array: np.ndarray, *parts: np.ndarray) -> np.ndarray:
    """The blocks' byte parts side by side, shaped as `array`'s rows."""
    return np.concatenate(parts, axis=1).reshape(*array.shape[:-1], -1)


TypeRule = Callable[[str, tuple[int, ...]], gguf.GGMLQuantizationType]


def write_wan_gguf(
    state: Mapping[str, torch.Tensor], path: str | Path, tensor_type: gguf.GGMLQuantizationType,
    num_heads: int | None = None, type_of: TypeRule | None = None,
) -> dict[str, gguf.GGMLQuantizationType]:
    """Write an original-layout Wan state dict as a GGUF of `tensor_type` (atomically: nothing appears under `path`
    unless all of it was written); returns each tensor's stored type. ``type_of(key, shape)``, when given, picks each
    tensor's type instead of `gguf_storage_type` (a file that mixes types, as llama.cpp's "K_M" files do)."""
    entries = [(key, tuple(tensor.shape)) for key, tensor in state.items()]
    return write_wan_gguf_streamed(entries, state.__getitem__, path, tensor_type, num_heads, type_of)


def write_wan_gguf_streamed(
    entries: list[tuple[str, tuple[int, ...]]], make: Callable[[str], torch.Tensor], path: str | Path,
    tensor_type: gguf.GGMLQuantizationType, num_heads: int | None = None, type_of: TypeRule | None = None,
) -> dict[str, gguf.GGMLQuantizationType]:
    """`write_wan_gguf` one tensor at a time: ``entries`` are (key, shape) in file order and ``make(key)`` returns
    that tensor when its turn comes, so at most one tensor (and its quantised copy) is in memory."""
    type_of = type_of or (lambda key, shape: gguf_storage_type(key, shape, tensor_type))
    stored = {key: type_of(key, shape) for key, shape in entries}
    with written_atomically(Path(path)) as temporary:
        writer = _writer(temporary, tensor_type, num_heads)
        for key, shape in entries:  # the header lists every tensor's type and size before any data
            byte_shape = gguf.quant_shape_to_byte_shape(shape, stored[key])
            writer.add_tensor_info(key, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=stored[key])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for key, shape in entries:
            writer.write_tensor_data(_stored_array(key, make(key), shape, stored[key]))
        writer.close()
    return stored


def _writer(path: Path, tensor_type: gguf.GGMLQuantizationType, num_heads: int | None) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), arch=WAN_ARCHITECTURE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tensor_type in _FILE_TYPES:
        writer.add_file_type(_FILE_TYPES[tensor_type])
    if num_heads is not None:
        writer.add_uint32(HEAD_COUNT_FIELD.format(arch=WAN_ARCHITECTURE), num_heads)
    return writer


def _stored_array(key: str, tensor: torch.Tensor, shape: tuple[int, ...],
                  stored: gguf.GGMLQuantizationType) -> np.ndarray:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{key}: made shape {tuple(tensor.shape)}, declared {tuple(shape)}")
    return quantize(tensor.detach().to(torch.float32).numpy(), stored)
