"""Writing Wan transformer GGUF files in the layout ComfyUI users have (original Wan key names,
``general.architecture`` "wan"); runs in the CLI process (`wanmesh make-tiny`) and tests.

Per-tensor types follow what the usual converters do: one-dimensional, very small (<= 1024 elements) and
``modulation`` tensors stay F32, the 5-D patch embedding stays F32 (it is added unquantised after
quantisation), and a matrix whose input dimension is not a whole number of the type's quant blocks falls back
to F16. Tensors are written with ``gguf.GGUFWriter`` and quantised with ``gguf.quants.quantize``, except
Q4_K: the gguf package dequantises K-quants but has no K-quant quantiser (llama.cpp's is C++), so
`quantize_q4_k` below packs Q4_K blocks by hand; the loader's tests check them against gguf's dequantiser.
Files are written atomically (``video_io.written_atomically``, as every output of the project is).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from ..models.gguf_file import HEAD_COUNT_FIELD, WAN_ARCHITECTURE, block_size
from ..video_io import written_atomically

__all__ = ["gguf_storage_type", "quantize", "quantize_q4_k", "write_wan_gguf"]

SMALL_TENSOR_ELEMENTS = 1024
MAX_QUANTISED_DIMS = 4
_Q = gguf.GGMLQuantizationType
_FILE_TYPES = {_Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, _Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
               _Q.F16: gguf.LlamaFileType.MOSTLY_F16}
_Q4_K_SUB_BLOCKS, _Q4_K_SUB_SIZE, _Q4_K_LEVELS, _Q4_K_SCALE_MAX = 8, 32, 15, 63


def gguf_storage_type(key: str, shape: tuple[int, ...], target: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The type a converter stores tensor `key` of `shape` as, when the file's type is `target`."""
    elements = int(np.prod(shape))
    if len(shape) == 1 or elements <= SMALL_TENSOR_ELEMENTS or "modulation" in key or len(shape) > MAX_QUANTISED_DIMS:
        return _Q.F32
    if shape[-1] % block_size(target):
        return _Q.F16
    return target


def quantize(array: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """`array` (float32) stored as `tensor_type`: gguf's quantisers, and `quantize_q4_k` for Q4_K."""
    if tensor_type == _Q.Q4_K:
        return quantize_q4_k(array)
    return gguf.quants.quantize(array, tensor_type)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `array` (rows of whole 256-element blocks): uint8 of shape (..., blocks x 144).

    Per 256-element block: f16 scale d and min dmin, eight 6-bit sub-block scales and mins (32 elements each),
    then 4-bit levels; an element is d * scale_j * level - dmin * min_j. This is a plain min/max fit, not
    llama.cpp's error-minimising search: enough for test files, checked by the gguf package's dequantiser.
    """
    rows = array.astype(np.float32).reshape(-1, _Q4_K_SUB_BLOCKS, _Q4_K_SUB_SIZE)
    sub_min = np.maximum(-rows.min(axis=-1), 0.0)  # dequantised values are d*sc*q - dmin*m with m >= 0
    sub_scale = (rows.max(axis=-1) + sub_min) / _Q4_K_LEVELS
    d = (sub_scale.max(axis=-1) / _Q4_K_SCALE_MAX).astype(np.float16)
    dmin = (sub_min.max(axis=-1) / _Q4_K_SCALE_MAX).astype(np.float16)
    scales = _six_bit(sub_scale, d)
    mins = _six_bit(sub_min, dmin)
    step = d.astype(np.float32)[:, None] * scales
    offset = dmin.astype(np.float32)[:, None] * mins
    levels = np.where(step[..., None] > 0, (rows + offset[..., None]) / np.where(step > 0, step, 1)[..., None], 0)
    levels = np.clip(np.rint(levels), 0, _Q4_K_LEVELS).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _pack_scales(scales.astype(np.uint8), mins.astype(np.uint8)),
                             _pack_levels(levels)], axis=1)
    return blocks.reshape(*array.shape[:-1], -1)


def _six_bit(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    unit = unit.astype(np.float32)[:, None]
    return np.clip(np.rint(np.where(unit > 0, values / np.where(unit > 0, unit, 1), 0)), 0, _Q4_K_SCALE_MAX)


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Twelve bytes: low 6 bits of scales/mins 0-3, high 2 bits of 4-7 on top, then 4-7's low nibbles."""
    low_scales = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    low_mins = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    nibbles = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low_scales, low_mins, nibbles], axis=1).astype(np.uint8)


def _pack_levels(levels: np.ndarray) -> np.ndarray:
    """128 bytes: sub-blocks 2c and 2c+1 share 32 bytes, low and high nibble."""
    pairs = levels.reshape(-1, _Q4_K_SUB_BLOCKS // 2, 2, _Q4_K_SUB_SIZE)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, _Q4_K_SUB_BLOCKS // 2 * _Q4_K_SUB_SIZE)


def write_wan_gguf(
    state: Mapping[str, torch.Tensor], path: str | Path, tensor_type: gguf.GGMLQuantizationType,
    num_heads: int | None = None,
) -> dict[str, gguf.GGMLQuantizationType]:
    """Write an original-layout Wan state dict as a GGUF of `tensor_type` (atomically: nothing appears under `path`
    unless all of it was written); returns each tensor's stored type."""
    with written_atomically(Path(path)) as temporary:
        return _write_gguf(state, temporary, tensor_type, num_heads)


def _write_gguf(state: Mapping[str, torch.Tensor], path: Path, tensor_type: gguf.GGMLQuantizationType,
                num_heads: int | None) -> dict[str, gguf.GGMLQuantizationType]:
    writer = gguf.GGUFWriter(str(path), arch=WAN_ARCHITECTURE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tensor_type in _FILE_TYPES:
        writer.add_file_type(_FILE_TYPES[tensor_type])
    if num_heads is not None:
        writer.add_uint32(HEAD_COUNT_FIELD.format(arch=WAN_ARCHITECTURE), num_heads)
    stored = {}
    for key, tensor in state.items():
        array = tensor.detach().to(torch.float32).numpy()
        stored[key] = gguf_storage_type(key, array.shape, tensor_type)
        writer.add_tensor(key, quantize(array, stored[key]), raw_dtype=stored[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
