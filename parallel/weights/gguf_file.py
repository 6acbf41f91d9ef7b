"""Wan transformer GGUF files (ComfyUI-GGUF layout: original Wan key names, ``general.architecture`` "wan"):
listing, checking and sharded dequantisation; runs in the workers (and the driver, for header-only checks).

A `GGUFFile` answers like `checkpoint.CheckpointFile` (keys, logical shapes, metadata), so the loaders'
"name map + per-tensor reader" design reads GGUF files unchanged. The file is memory-mapped by
``gguf.GGUFReader``; a read touches only the rows it asks for. Quant blocks run along the innermost
(input) dimension, so any slice of the outer dimensions (a column-parallel layer's output rows) is cheap,
while a slice of the input dimension (a row-parallel layer) stays quantized only when it starts and ends on
quant-block boundaries; a slice that cuts blocks is read as whole rows, dequantized, then cut.
`read_stored` gives a quantized tensor's blocks as stored (`quantized.StoredTensor`), for layers that keep them;
`read_dequantised` decodes with the same torch dequantizer (`dequant.py`) to the compute dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np
import torch

from ..config import LATENT_CHANNEL_COUNTS
from .checkpoint import COMFY_TRANSFORMER_PREFIX, CheckpointFile, ModelFileError, TensorSlice
from .dequant import SUPPORTED_TYPES, supported_names  # the types this package can dequantise are the ones a file may hold
from .quantized import StoredTensor, dequantize_stored

__all__ = ["GGUF_SUFFIX", "GGUFFile", "open_files", "SUPPORTED_TYPES", "WAN_ARCHITECTURE", "block_size", "is_gguf_path"]

GGUF_SUFFIX = ".gguf"
WAN_ARCHITECTURE = "wan"
ORIGINAL_SHAPE_FIELD = "comfy.gguf.orig_shape."  # ComfyUI-GGUF's key for tensors stored reshaped
HEAD_COUNT_FIELD = "{arch}.attention.head_count"
_Q = gguf.GGMLQuantizationType
FLOAT_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16})


def is_gguf_path(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


def block_size(tensor_type: gguf.GGMLQuantizationType) -> int:
    """Elements per quant block along the input dimension (1 for float types)."""
    return gguf.GGML_QUANT_SIZES[tensor_type][0]


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
            raise ModelFileError(f"{self.path}: cannot read as GGUF: the file is truncated, corrupt or not a GGUF file "
                                 f"({type(error).__name__}: {first_line})") from None
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
                f"({len(unsupported)} such tensors); supported types: {supported_names()}")

    def _check_latent_channels(self) -> None:
        shapes = {key.removeprefix(COMFY_TRANSFORMER_PREFIX): shape for key, shape in self._shapes.items()}
        head, patch = shapes.get("head.head.weight"), shapes.get("patch_embedding.weight")
        if head is None or patch is None or len(patch) != 5:
            return  # not recognisably a Wan transformer: the loader's kind detection says what it is
        channels = head[0] // math.prod(patch[2:])
        if channels not in LATENT_CHANNEL_COUNTS:
            raise ModelFileError(
                f"{self.path}: the model predicts {channels}-channel latents; supported: Wan 2.1 / 2.2 A14B "
                f"transformers (16-channel latents) and Wan 2.2 TI2V 5B (48-channel latents)")

    def is_quantized(self, key: str) -> bool:
        return self.tensor_type(key) not in FLOAT_TYPES

    # -- reading --------------------------------------------------------------------------------------

    def read_stored(self, key: str, index: TensorSlice = None) -> StoredTensor | None:
        """The quant blocks of `key` (or of `index` of it) as stored; None for float tensors, tensors stored
        reshaped, and input slices that cut quant blocks."""
        if not self.is_quantized(key) or self._stored_reshaped(key):
            return None
        index = _full_index(index, len(self.shape(key)))
        if not self._on_blocks(key, index[-1]):
            return None
        return StoredTensor(self._stored_rows(key, index), self.tensor_type(key), _sliced_shape(self.shape(key), index),
                            owned=True)

    def read_dequantised(self, key: str, dtype: torch.dtype, index: TensorSlice = None) -> torch.Tensor:
        """Tensor `key` (or `index` of it, decoding only its rows) as `dtype`."""
        shape, tensor_type = self.shape(key), self.tensor_type(key)
        index = _full_index(index, len(shape))
        if self._stored_reshaped(key):
            # Stored reshaped (ComfyUI-GGUF's shape fix): blocks no longer follow the rows, so decode it whole.
            whole = torch.from_numpy(np.array(self._tensors[key].data, copy=True))
            return dequantize_stored(whole, tensor_type, shape, torch.float32)[index].to(dtype).contiguous()
        if self._on_blocks(key, index[-1]):
            return dequantize_stored(self._stored_rows(key, index), tensor_type, _sliced_shape(shape, index), dtype)
        rows = index[:-1] + (slice(None),)  # the slice cuts quant blocks: decode whole rows, then cut
        values = dequantize_stored(self._stored_rows(key, rows), tensor_type, _sliced_shape(shape, rows), torch.float32)
        return values[..., index[-1]].to(dtype).contiguous()

    def _stored_reshaped(self, key: str) -> bool:
        return tuple(int(d) for d in reversed(self._tensors[key].shape)) != self.shape(key)

    def _on_blocks(self, key: str, columns: slice) -> bool:
        width = self.shape(key)[-1]
        start, stop, step = columns.indices(width)
        block = block_size(self.tensor_type(key))
        return step == 1 and start % block == 0 and (stop % block == 0 or stop == width)

    def _stored_rows(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """A private copy of the stored rows `index[:-1]`, columns `index[-1]` (on quant-block boundaries): bytes,
        or typed values for F32/F16. Outer dims index the stored rows directly; only those pages are read."""
        stored = np.asarray(self._tensors[key].data)
        columns = self._stored_columns(key, index[-1], in_bytes=stored.dtype == np.uint8)
        return torch.from_numpy(np.array(stored[index[:-1]][..., columns], copy=True))

    def _stored_columns(self, key: str, columns: slice, in_bytes: bool) -> slice:
        """The stored columns of each row holding input elements `columns` (which sit on block boundaries)."""
        tensor_type, width = self.tensor_type(key), self.shape(key)[-1]
        start, stop, _ = columns.indices(width)
        block, bytes_per_block = gguf.GGML_QUANT_SIZES[tensor_type]
        unit = bytes_per_block if in_bytes else block
        return slice(start // block * unit, math.ceil(stop / block) * unit)


def _sliced_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*entry.indices(size))) for entry, size in zip(index, shape))


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


def open_files(paths: Iterable[Path], stack: contextlib.ExitStack) -> list[CheckpointFile | GGUFFile]:
    """Open several weight files, each by its format (GGUF here; safetensors and pickles as
    ``checkpoint.CheckpointFile``), closing them when ``stack`` closes."""
    files = []
    for path in paths:
        checkpoint = GGUFFile(path) if is_gguf_path(path) else CheckpointFile(path)
        stack.callback(checkpoint.close)
        files.append(checkpoint)
    return files
