"""Reading model weight files: safetensors (and weights-only pickles) as name maps plus per-tensor readers.

A checkpoint is opened once and described by its keys, shapes and metadata without reading any tensor.
Loaders turn it into a `WeightSource`: a map from the model's own parameter names to tensors in one or
more files. Tensors are read one by one (optionally only a slice, for tensor-parallel ranks), either dequantised
on the way (plain fp8 is upcast, ComfyUI "scaled fp8" weights are multiplied by their per-layer `scale_weight`)
or, with `read_stored`, as the file stores them (`quantized.StoredTensor`), for layers that stay quantized.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .quantized import FP8, NARROW_FLOAT, StoredTensor, dequantize_stored, hold_stored_, keeps_quantized

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
COMFY_TRANSFORMER_PREFIX = "model.diffusion_model."
SCALED_FP8_MARKER = "scaled_fp8"
_SCALE_WEIGHT_SUFFIX = ".scale_weight"
_SCALE_INPUT_SUFFIX = ".scale_input"
_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_MAX_HEADER_BYTES = 100 * 1024 * 1024
log = logging.getLogger("wanmesh.weights")

TensorSlice = tuple[slice | int, ...] | slice | None


class ModelFileError(ValueError):
    """A model file or folder is missing, unreadable, or not the kind of model that was asked for."""


def _describe_size(num_bytes: int) -> str:
    return f"{num_bytes} bytes" if num_bytes < 1024 * 1024 else f"{num_bytes / 2**20:.1f} MiB"


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, ``__metadata__``), checked; no data read."""
    return _check_safetensors_header(Path(path))


def _check_safetensors_header(path: Path) -> dict:
    """Validate the 8-byte length prefix and JSON header so corrupt files fail with a readable message."""
    size = path.stat().st_size
    if size < 8:
        raise ModelFileError(
            f"{path}: not a safetensors file (file is {_describe_size(size)}, too short for a header)."
        )
    with path.open("rb") as stream:
        (header_len,) = struct.unpack("<Q", stream.read(8))
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ModelFileError(
                f"{path}: not a valid safetensors file (file is {_describe_size(size)}, its header claims "
                f"{header_len} bytes of JSON); the file is truncated or is not safetensors."
            )
        raw_header = stream.read(header_len)
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFileError(
            f"{path}: corrupt safetensors header (file is {_describe_size(size)}): {error}."
        ) from None
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise ModelFileError(
            f"{path}: truncated safetensors file (file is {_describe_size(size)}, its header needs "
            f"{_describe_size(8 + header_len + data_end)})."
        )
    return header


class CheckpointFile:
    """One open weight file: keys, shapes, dtypes and metadata, with tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"Model file not found: {self.path}")
        self._handle: Any = None
        self._tensors: Mapping[str, torch.Tensor] | None = None
        self.metadata: dict[str, str] = {}
        if self.path.suffix.lower() in PICKLE_SUFFIXES:
            self._tensors = _load_pickle_state_dict(self.path)
        else:
            _check_safetensors_header(self.path)
            try:
                self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            except Exception as error:  # safetensors raises its own error types
                raise ModelFileError(f"{self.path}: cannot open as safetensors: {error}") from None
            self.metadata = dict(self._handle.metadata() or {})
        self.keys: list[str] = list(self._tensors if self._tensors is not None else self._handle.keys())
        self._key_set = set(self.keys)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._tensors is not None:
            return tuple(self._tensors[key].shape)
        return tuple(self._handle.get_slice(key).get_shape())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: self.shape(key) for key in self.keys}

    def stored_dtype(self, key: str) -> torch.dtype:
        if self._tensors is not None:
            return self._tensors[key].dtype
        return _SAFETENSORS_DTYPES[self._handle.get_slice(key).get_dtype()]

    def is_quantized(self, key: str) -> bool:
        return self.stored_dtype(key) in _FP8_DTYPES

    def read_narrow(self, key: str, compute_dtype: torch.dtype, index: TensorSlice = None) -> StoredTensor | None:
        """A bf16 / fp16 tensor (or slice) as stored, when ``compute_dtype`` is wider; None otherwise."""
        stored = self.stored_dtype(key)
        if stored not in (torch.bfloat16, torch.float16) or compute_dtype.itemsize <= stored.itemsize:
            return None
        data = self.raw(key, index)
        return StoredTensor(data, NARROW_FLOAT, tuple(data.shape))

    def read_stored(self, key: str, index: TensorSlice = None) -> StoredTensor | None:
        """An fp8 weight (or slice) as stored, with its scale; None for a float tensor."""
        if not self.is_quantized(key):
            return None
        data = self.raw(key, index)
        scale_key = scale_key_for(key)
        scale = self.raw(scale_key).to(torch.float32) if scale_key is not None and self.has(scale_key) else None
        return StoredTensor(data, FP8, tuple(data.shape), scale)

    def raw(self, key: str, index: TensorSlice = None) -> torch.Tensor:
        """The stored tensor (or a slice of it) without any dtype conversion."""
        if self._tensors is not None:
            tensor = self._tensors[key]
            return tensor if index is None else tensor[index]
        if index is None:
            return self._handle.get_tensor(key)
        return self._handle.get_slice(key)[index]

    def has(self, key: str) -> bool:
        return key in self._key_set

    @property
    def is_scaled_fp8(self) -> bool:
        return self.has(SCALED_FP8_MARKER) or any(key.endswith(_SCALE_WEIGHT_SUFFIX) for key in self.keys)

    def weight_keys(self) -> list[str]:
        """Keys that hold model weights: fp8 scale factors and markers are not weights themselves."""
        return [key for key in self.keys if not is_quantisation_key(key)]

    def close(self) -> None:
        self._handle = None
        self._tensors = None


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **({"F8_E4M3": torch.float8_e4m3fn} if hasattr(torch, "float8_e4m3fn") else {}),
    **({"F8_E5M2": torch.float8_e5m2} if hasattr(torch, "float8_e5m2") else {}),
}


def _load_pickle_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # weights_only refuses arbitrary pickled objects: say so plainly, in one short line
        logging.getLogger("wanmesh").info("%s: weights-only load refused: %s: %s", path, type(error).__name__, error)
        raise ModelFileError(
            f"{path.name}: the weights-only loader refused it ({type(error).__name__}: "
            f"{pickle_refusal_reason(error)[:120]}; details in the log); convert it to .safetensors"
        ) from None
    for wrapper_key in ("state_dict", "model", "module"):
        if isinstance(loaded, dict) and isinstance(loaded.get(wrapper_key), dict) and len(loaded) <= 3:
            loaded = loaded[wrapper_key]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ModelFileError(f"{path}: expected a dict of tensors (a state dict), found {type(loaded).__name__}.")
    return loaded


def pickle_refusal_reason(error: BaseException) -> str:
    """What torch's weights-only unpickler found, without its advice to load with ``weights_only=False`` (which
    would run the pickle's code): the first line that is neither that advice nor a pointer to the docs."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    advice = ("weights_only", "weights only load failed", "documentation", "trusted source", "unsafe_globals")
    reasons = [line for line in lines if not any(word in line.lower() for word in advice)]
    return reasons[0][:200] if reasons else "the file holds objects other than tensors"


def is_quantisation_key(key: str) -> bool:
    return key == SCALED_FP8_MARKER or key.endswith(_SCALE_WEIGHT_SUFFIX) or key.endswith(_SCALE_INPUT_SUFFIX)


def read_tensor(
    handle: CheckpointFile, original_key: str, dtype: torch.dtype, index: TensorSlice = None
) -> torch.Tensor:
    """Read one tensor (or a slice of it) as `dtype`, dequantising fp8 (times its scaled-fp8 factor) and GGUF."""
    if hasattr(handle, "read_dequantised"):  # a GGUF file dequantises its own blocks (weights/gguf_file.py)
        return handle.read_dequantised(original_key, dtype, index)
    stored = handle.read_stored(original_key, index)
    if stored is not None:
        return dequantize_stored(stored.data, stored.qtype, stored.shape, dtype, stored.scale)
    return handle.raw(original_key, index).to(dtype)


def scale_key_for(weight_key: str) -> str | None:
    """The key of a scaled-fp8 weight's ``scale_weight`` (None for a key that is not a weight)."""
    if not weight_key.endswith(".weight"):
        return None
    return weight_key[: -len(".weight")] + _SCALE_WEIGHT_SUFFIX


def strip_prefix(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Map each key to itself without `prefix` (only when every weight key carries it)."""
    keys = list(keys)
    if keys and all(key.startswith(prefix) for key in keys):
        return {key[len(prefix):]: key for key in keys}
    return {key: key for key in keys}


def rename_map(
    original_keys: Iterable[str], convert: Callable[[dict[str, str]], dict[str, str]]
) -> dict[str, str]:
    """{converted_key: original_key} from a key-renaming converter, without reading any tensor.

    diffusers' single-file converters only rename keys, so running them on a dict whose values are the
    original names yields the name map.
    """
    converted = convert({key: key for key in original_keys})
    if any(not isinstance(value, str) for value in converted.values()):
        raise TypeError("key converter split or transformed tensors; it cannot be used as a pure name map")
    return converted


@dataclass(frozen=True)
class TensorRef:
    """Where one model tensor lives: which open file, under which stored key."""

    file: CheckpointFile
    key: str


class WeightSource:
    """Model parameter names mapped to tensors in open checkpoint files, read lazily."""

    def __init__(self, refs: Mapping[str, TensorRef], description: str):
        self.refs = dict(refs)
        self.description = description

    def names(self) -> list[str]:
        return list(self.refs)

    def shape(self, name: str) -> tuple[int, ...]:
        ref = self.refs[name]
        return ref.file.shape(ref.key)

    def read(self, name: str, dtype: torch.dtype, index: TensorSlice = None) -> torch.Tensor:
        ref = self.refs[name]
        return read_tensor(ref.file, ref.key, dtype, index)

    def read_stored(self, name: str, index: TensorSlice = None) -> StoredTensor | None:
        """The tensor as its file stores it when that is quantized (fp8, GGUF blocks), else None."""
        ref = self.refs[name]
        return ref.file.read_stored(ref.key, index)

    def is_quantized(self, name: str) -> bool:
        ref = self.refs[name]
        return ref.file.is_quantized(ref.key)

    def read_narrow(self, name: str, compute_dtype: torch.dtype, index: TensorSlice = None) -> StoredTensor | None:
        """A float tensor stored narrower than ``compute_dtype`` (bf16 / fp16 for float32), as stored; None for
        other tensors and for files that do not tell (GGUF, pickles read whole)."""
        ref = self.refs[name]
        read = getattr(ref.file, "read_narrow", None)
        return None if read is None else read(ref.key, compute_dtype, index)

    def merged_with(self, other: WeightSource) -> WeightSource:
        return WeightSource({**self.refs, **other.refs}, f"{self.description} + {other.description}")


def list_safetensors_shards(folder: Path, weights_name: str) -> list[Path]:
    """The safetensors files of a diffusers/transformers model folder, single-file or sharded."""
    index_files = sorted(folder.glob(f"{weights_name}*.safetensors.index.json"))
    if index_files:
        weight_map = json.loads(index_files[0].read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    preferred = sorted(folder.glob(f"{weights_name}*.safetensors"))
    found = preferred or sorted(folder.glob("*.safetensors"))
    if not found:
        raise ModelFileError(
            f"No .safetensors weights found in folder {folder} (expected {weights_name}.safetensors or a "
            f"sharded {weights_name}.safetensors.index.json)."
        )
    return found


def resolve_model_location(path: str | Path, component: str) -> Path:
    """The file, or the model folder of `component` (itself, or inside a pipeline folder)."""
    location = Path(path)
    if location.is_file():
        return location
    if location.is_dir():
        if (location / "model_index.json").is_file():
            sub_folder = location / component
            if not (sub_folder / "config.json").is_file():
                raise ModelFileError(
                    f"Pipeline folder {location} has no '{component}/config.json' (it has: "
                    f"{', '.join(sorted(p.name for p in location.iterdir()))})."
                )
            return sub_folder
        if (location / "config.json").is_file():
            return location
        raise ModelFileError(
            f"Folder {location} is not a model: expected config.json (a diffusers/transformers model folder) or "
            f"model_index.json (a diffusers pipeline folder)."
        )
    parent = location.parent
    listing = sorted(p.name for p in parent.iterdir())[:10] if parent.is_dir() else None
    where = f"searched folder {parent}, which holds: {', '.join(listing) or 'nothing'}" if listing is not None \
        else f"folder {parent} does not exist"
    raise ModelFileError(f"Model file not found: {location.name} ({where}).")


def first_names(names: Iterable[str], count: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(names[:count])
    return shown + (f", ... ({len(names)} in all)" if len(names) > count else "")


def build_empty(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Construct a model with parameters on the meta device: no memory, no random init.

    Buffers stay real because models compute some of them in __init__ (e.g. RoPE tables) and they are
    not in the state dict.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return factory()


def _keeps_float32(name: str, keep_modules: Iterable[str]) -> bool:
    return bool(set(name.split(".")) & set(keep_modules))


def _hold_quantized_(model: torch.nn.Module, source: WeightSource, names: set[str], dtype: torch.dtype,
                     device: str | torch.device) -> set[str]:
    """Give each linear that may stay quantized (``quantized.keeps_quantized``) and is stored quantized its stored
    data (this rank's slice); the names held. A tensor whose slice cannot stay quantized (it would cut GGUF quant
    blocks) is left to the float path and logged."""
    held, cut = set(), []
    for name in sorted(names):
        module = model.get_submodule(name.rpartition(".")[0])
        if not (keeps_quantized(name) and _is_linear(module)):
            continue
        if not source.is_quantized(name):  # a bf16 / fp16 weight computed in float32 stays as stored too
            stored = source.read_narrow(name, dtype)
            if stored is not None:
                hold_stored_(module, stored, dtype, device)
                held.add(name)
            continue
        stored = source.read_stored(name)
        if stored is None:
            cut.append(name)
            continue
        hold_stored_(module, stored, dtype, device)
        held.add(name)
    if cut:
        cost = sum(math.prod(source.shape(name)) for name in cut) * dtype.itemsize
        log.warning("%s: %d tensors (%.1f MiB) dequantized at load on this rank: its tensor-parallel slices of them "
                    "would cut their quant blocks (e.g. %s)", source.description, len(cut), cost / 2**20, cut[0])
    return held


def _is_linear(module: torch.nn.Module) -> bool:
    from ..distributed.tensor_parallel import RowParallelLinear

    return isinstance(module, (torch.nn.Linear, RowParallelLinear))


def load_weights_into(
    model: torch.nn.Module,
    source: WeightSource,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    aliases: Mapping[str, str] | None = None,
    keep_quantized: bool = False,
) -> torch.nn.Module:
    """Fill an empty model from `source`, checking the names match exactly; returns it in eval mode.

    `aliases` maps a model name to another model name sharing the same tensor (tied embeddings).
    Modules the model class lists in `_keep_in_fp32_modules` stay float32, as its own loader would do.
    With `keep_quantized`, linears stored quantized keep their stored data (`quantized.hold_stored_`).
    """
    aliases = dict(aliases or {})
    expected = set(model.state_dict()) - set(aliases)
    provided = set(source.names())
    missing, unexpected = expected - provided, provided - expected
    if missing or unexpected:
        details = []
        if missing:
            details.append(f"missing {len(missing)} tensors: {first_names(missing)}")
        if unexpected:
            details.append(f"unexpected {len(unexpected)} tensors: {first_names(unexpected)}")
        raise ModelFileError(
            f"{source.description}: weights do not match a {type(model).__name__} built from the inferred "
            f"config ({'; '.join(details)})."
        )
    keep_modules = getattr(model, "_keep_in_fp32_modules", None) or ()
    held = _hold_quantized_(model, source, expected, dtype, device) if keep_quantized else set()
    state = {}
    for name in sorted(expected - held):
        target = torch.float32 if dtype != torch.float32 and _keeps_float32(name, keep_modules) else dtype
        # A private copy: tensors read from a mapped file may sit at unaligned offsets, which makes CPU
        # kernels take different (differently rounding) paths depending on the file's layout.
        state[name] = source.read(name, target).to(device, copy=True)
    for alias, original in aliases.items():
        state[alias] = state[original]
    result = model.load_state_dict(state, strict=False, assign=True)
    held_keys = {f"{name.rpartition('.')[0]}.parametrizations.weight.original" for name in held}
    if result.unexpected_keys or set(result.missing_keys) != held_keys:
        raise ModelFileError(f"{source.description}: loading left {first_names(set(result.missing_keys) - held_keys)} "
                             f"unset and {first_names(result.unexpected_keys)} unused")
    model.to(device)
    model.eval().requires_grad_(False)
    return model
