"""Wan transformer GGUF files (ComfyUI-GGUF layout: original Wan key names, ``general.architecture`` "wan"):
listing, checking and sharded dequantisation; runs in the workers (and the driver, for header-only checks).

A `GGUFFile` answers like `checkpoint.CheckpointFile` (keys, logical shapes, metadata), so the loaders'
"name map + per-tensor reader" design reads GGUF files unchanged. The file is memory-mapped by
``gguf.GGUFReader``; a read touches only the rows it asks for. Quant blocks run along the innermost
(input) dimension, so any slice of the outer dimensions (a column-parallel layer's output rows) is cheap,
while a slice of the input dimension (a row-parallel layer) must start and end on quant-block boundaries.
Dequantisation uses the gguf package's own dequantisers, to float32, then casts to the compute dtype.
Weights are not kept quantised in memory: that would need quantised matmul kernels (per-type, per-device)
and a sharded linear that dequantises on the fly; loading dense weights keeps every parallel plan as is.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from .checkpoint import COMFY_TRANSFORMER_PREFIX, ModelFileError, TensorSlice
from .dequant import SUPPORTED_TYPES  # the types this package can dequantise are the ones a file may hold

__all__ = ["GGUF_SUFFIX", "GGUFFile", "SUPPORTED_TYPES", "WAN_ARCHITECTURE", "block_size", "is_gguf_path"]

GGUF_SUFFIX = ".gguf"
WAN_ARCHITECTURE = "wan"
ORIGINAL_SHAPE_FIELD = "comfy.gguf.orig_shape."  # ComfyUI-GGUF's key for tensors stored reshaped
HEAD_COUNT_FIELD = "{arch}.attention.head_count"
WAN_LATENT_CHANNELS = 16  # Wan 2.1 / 2.2 A14B; the 5B TI2V model uses 48-channel latents


def is_gguf_path(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


def block_size(tensor_type: gguf.GGMLQuantizationType) -> int:
    """Elements per quant block along the input dimension (1 for float types)."""
    return gguf.GGML_QUANT_SIZES[tensor_type][0]


def _supported_names() -> str:
    return ", ".join(sorted(quant.name for quant in SUPPORTED_TYPES))


def _string_field(reader: gguf.GGUFReader, name: str) -> str | None:
    field = reader.get_field(name)
    return None if field is None else str(field.contents())


class GGUFFile:
    """One open Wan transformer GGUF: keys, logical shapes (GGUF stores dims reversed), types, sliced reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"Model file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as error:  # the reader raises ValueError/struct errors on foreign or truncated files
            first_line = (str(error).splitlines() or [""])[0]
            raise ModelFileError(f"{self.path}: cannot read as GGUF ({type(error).__name__}: {first_line})") from None
        self.architecture = _string_field(self._reader, gguf.Keys.General.ARCHITECTURE)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self.keys: list[str] = list(self._tensors)
        self._shapes = {key: self._logical_shape(key) for key in self.keys}
        self.metadata: dict[str, str] = self._model_metadata()
        self._check_architecture()
        self._check_types()
        self._check_latent_channels()

    # -- description (the CheckpointFile interface) ----------------------------------------------------

    def _logical_shape(self, key: str) -> tuple[int, ...]:
        field = self._reader.get_field(ORIGINAL_SHAPE_FIELD + key)
        if field is not None:
            return tuple(int(value) for value in field.contents())
        return tuple(int(dim) for dim in reversed(self._tensors[key].shape))

    def _model_metadata(self) -> dict[str, str]:
        """Metadata the shape-based config inference reads: the head count, when the file carries it."""
        field = self._reader.get_field(HEAD_COUNT_FIELD.format(arch=self.architecture or WAN_ARCHITECTURE))
        return {} if field is None else {"num_heads": str(int(field.contents()))}

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def tensor_type(self, key: str) -> gguf.GGMLQuantizationType:
        return self._tensors[key].tensor_type

    def has(self, key: str) -> bool:
        return key in self._tensors

    is_scaled_fp8 = False

    def weight_keys(self) -> list[str]:
        return list(self.keys)

    def close(self) -> None:
        self._tensors = {}
        self._reader = None

    # -- checks, before any tensor is read --------------------------------------------------------------

    def _check_architecture(self) -> None:
        if self.architecture not in (None, WAN_ARCHITECTURE):
            raise ModelFileError(
                f"{self.path}: a GGUF of architecture {self.architecture!r}, not a Wan transformer "
                f"(expected general.architecture {WAN_ARCHITECTURE!r}, as ComfyUI-GGUF writes Wan files)")

    def _check_types(self) -> None:
        unsupported = [key for key in self.keys if self.tensor_type(key) not in SUPPORTED_TYPES]
        if unsupported:
            key = unsupported[0]
            raise ModelFileError(
                f"{self.path}: tensor {key} has GGUF type {self.tensor_type(key).name}, which cannot be loaded "
                f"({len(unsupported)} such tensors); supported types: {_supported_names()}")

    def _check_latent_channels(self) -> None:
        shapes = {key.removeprefix(COMFY_TRANSFORMER_PREFIX): shape for key, shape in self._shapes.items()}
        head, patch = shapes.get("head.head.weight"), shapes.get("patch_embedding.weight")
        if head is None or patch is None or len(patch) != 5:
            return  # not recognisably a Wan transformer: the loader's kind detection says what it is
        channels = head[0] // math.prod(patch[2:])
        if channels != WAN_LATENT_CHANNELS:
            raise ModelFileError(
                f"{self.path}: the model predicts {channels}-channel latents; only Wan 2.1 / 2.2 A14B transformers "
                f"({WAN_LATENT_CHANNELS}-channel latents) are supported, not the 48-channel Wan 2.2 TI2V 5B")

    def check_input_split(self, key: str, parts: int) -> None:
        """Fail when cutting the input (last) dimension of `key` into `parts` equal slices misses block boundaries."""
        shape, tensor_type = self.shape(key), self.tensor_type(key)
        block = block_size(tensor_type)
        if shape[-1] % parts or (shape[-1] // parts) % block:
            raise ModelFileError(
                f"{self.path}: tensor {key} of shape {shape} and type {tensor_type.name} cannot be split along its "
                f"input dimension ({shape[-1]}) into {parts} parts on its {block}-element quant blocks (tp={parts}); "
                f"use a tp degree that cuts it on block boundaries or a file with another quant type")

    # -- reading --------------------------------------------------------------------------------------

    def read_dequantised(self, key: str, dtype: torch.dtype, index: TensorSlice = None) -> torch.Tensor:
        """Tensor `key` (or `index` of it, dequantising only that part) as `dtype`."""
        shape = self.shape(key)
        index = _full_index(index, len(shape))
        tensor = self._tensors[key]
        if tuple(int(d) for d in reversed(tensor.shape)) != shape:
            # Stored reshaped (ComfyUI-GGUF's shape fix): blocks no longer follow the rows, so read it whole.
            whole = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
            return torch.from_numpy(np.ascontiguousarray(whole[index])).to(dtype)
        stored = np.asarray(tensor.data)
        # Outer dims index the stored rows directly; the last dim holds blocks as bytes, or typed floats (F32/F16).
        columns = self._stored_columns(key, index[-1], in_bytes=stored.dtype == np.uint8)
        raw = stored[index[:-1]][..., columns]
        values = gguf.quants.dequantize(np.ascontiguousarray(raw), tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(dtype)

    def _stored_columns(self, key: str, columns: slice, in_bytes: bool) -> slice:
        """The stored columns of each row holding input elements `columns` (which must sit on block boundaries)."""
        tensor_type, width = self.tensor_type(key), self.shape(key)[-1]
        start, stop, step = columns.indices(width)
        block, bytes_per_block = gguf.GGML_QUANT_SIZES[tensor_type]
        if step != 1 or start % block or (stop % block and stop != width):
            raise ModelFileError(
                f"{self.path}: tensor {key} of shape {self.shape(key)} and type {tensor_type.name}: the input slice "
                f"[{start}:{stop}] does not start and end on its {block}-element quant blocks")
        unit = bytes_per_block if in_bytes else block
        return slice(start // block * unit, math.ceil(stop / block) * unit)


def _full_index(index: TensorSlice, ndim: int) -> tuple[slice, ...]:
    """`index` as one slice per dimension (integers become length-one slices, kept by the caller's shape)."""
    if index is None:
        index = ()
    elif not isinstance(index, tuple):
        index = (index,)
    if len(index) > ndim:
        raise ValueError(f"index {index} has more entries than the tensor's {ndim} dimensions")
    if any(not isinstance(entry, slice) for entry in index):
        raise ValueError(f"GGUF tensors are read by slices only, got index {index}")
    return tuple(index) + (slice(None),) * (ndim - len(index))
