"""Moving tensors between the pool driver and its workers without pickling them through a pipe.

Local backend: the sender copies every tensor of a message into a named POSIX shared-memory segment it owns
(an *arena*, reused and grown across messages so pages are not faulted in afresh each time) and sends small
descriptors ``{segment, offset, dtype, shape}``; receivers map the segment and view or copy the bytes. Every
local worker maps the same request segment, so a request reaches all ranks with one copy.

Ray backend: tensors travel as raw-byte numpy arrays, which Ray places in its shared-memory object store.

Segments are created with ``multiprocessing.shared_memory`` and mapped with ``torch.from_file``, whose storage
keeps the mapping alive exactly as long as some tensor views it. The driver owns the clean-up of every
segment, its workers' included: they are registered with the driver's resource tracker (Python's own, which
unlinks them if the driver dies) and unlinked when a pool generation ends, also when its workers were killed.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

SHM_DIR = "/dev/shm"
ALIGN = 64
MIN_SEGMENT = 1 << 20
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
    )
}


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be transported; supported: {', '.join(DTYPES)}")
    return name


def _segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


SEGMENT_NAME_START = "wanmesh_"


def new_segment_prefix() -> str:
    """A prefix unique to one pool, so its segments can be found and removed after a crash; it names the
    driver's pid (``segment_owner_pid``)."""
    return f"{SEGMENT_NAME_START}{os.getpid()}_{secrets.token_hex(4)}"


def segment_owner_pid(name: str) -> int | None:
    """The pid of the driver whose pool made segment ``name`` (None for a name this pack did not make)."""
    if not name.startswith(SEGMENT_NAME_START):
        return None
    owner = name[len(SEGMENT_NAME_START):].split("_")[0]
    return int(owner) if owner.isdigit() else None


def _check_shm_space(nbytes: int) -> None:
    """Writing past a full tmpfs kills the process with SIGBUS, so refuse early with a readable reason."""
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"the shared-memory transport needs {SHM_DIR} (Linux); it does not exist here")
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise RuntimeError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free but moving these tensors needs {nbytes / 2**20:.0f} MiB; "
            "enlarge it (for Docker: --shm-size) or move smaller tensors"
        )


def _map_segment(name: str, nbytes: int, shared: bool = True) -> torch.Tensor:
    """``shared=False`` maps copy-on-write: reads see the segment, writes stay private to this process."""
    return torch.from_file(_segment_path(name), shared=shared, size=nbytes, dtype=torch.uint8)


class ShmWriter:
    """One process's outgoing arena: a shared-memory segment reused for message after message.

    A message's tensors must be read by the receivers before the next message is packed; the pool's
    request/reply discipline guarantees that (one request in flight, rank 0 replies once per request).
    """

    def __init__(self, prefix: str, tracked: bool = True):
        """``tracked=False``: this process's resource tracker does not own the segments (a worker's, which
        the driver adopts), so killing the process neither unlinks them twice nor warns about leaks."""
        self.prefix = prefix
        self.tracked = tracked
        self._counter = 0
        self._segment: shared_memory.SharedMemory | None = None
        self._buffer: torch.Tensor | None = None
        self._cursor = 0

    @property
    def segment_names(self) -> list[str]:
        return [self._segment.name] if self._segment is not None else []

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Start a message holding ``tensors``: make room for all of them and rewind."""
        needed = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
        self._cursor = 0
        if needed and (self._buffer is None or self._buffer.numel() < needed):
            self._grow(max(needed + needed // 4, MIN_SEGMENT))

    def _grow(self, nbytes: int) -> None:
        _check_shm_space(nbytes)
        self.close()
        self._counter += 1
        segment = shared_memory.SharedMemory(name=f"{self.prefix}_{self._counter}", create=True, size=nbytes)
        if not self.tracked:
            resource_tracker.unregister(segment._name, "shared_memory")  # the public switch arrives in 3.13
        self._buffer = _map_segment(segment.name, nbytes)
        segment.close()  # our mapping is torch's; the name stays until unlink
        self._segment = segment

    def pack(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Copy ``tensor`` (any device, any layout) into the arena and describe where it lies."""
        nbytes = tensor.numel() * tensor.element_size()
        descriptor = {"segment": None, "offset": 0, "dtype": _dtype_name(tensor), "shape": list(tensor.shape)}
        if nbytes == 0:
            return descriptor
        if self._buffer is None or self._cursor + nbytes > self._buffer.numel():
            raise RuntimeError("ShmWriter.pack called for more bytes than reserve() was told about")
        target = self._buffer[self._cursor : self._cursor + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor.detach())
        descriptor.update(segment=self._segment.name, offset=self._cursor)
        self._cursor += _aligned(nbytes)
        return descriptor

    def release(self) -> None:
        """Drop our mapping but keep the segment: its receiver unlinks it (``take_handed_over``)."""
        self._buffer = None
        self._segment = None

    def close(self) -> None:
        """Drop our mapping and unlink the segment (receivers' existing mappings stay valid)."""
        self._buffer = None
        if self._segment is not None:
            try:
                if self.tracked:
                    self._segment.unlink()
                else:
                    os.unlink(_segment_path(self._segment.name))
            except FileNotFoundError:
                pass
            self._segment = None


class ShmReader:
    """Maps the segments named in descriptors (cached by name) and returns views or copies of tensors.

    ``copy_on_write=True`` (workers) maps privately: a handler that writes into a request tensor changes
    only its own pages, never the sender's arena that the other ranks read. Such mappings must be dropped
    (``forget_except``) before the next message, or pages written earlier would hide the new contents.
    """

    def __init__(self, copy_on_write: bool = False):
        self._maps: dict[str, torch.Tensor] = {}
        self._shared = not copy_on_write

    def view(self, descriptor: dict[str, Any]) -> torch.Tensor:
        """A tensor that aliases the sender's arena: valid only until the sender packs its next message."""
        dtype = DTYPES[descriptor["dtype"]]
        shape = descriptor["shape"]
        if descriptor["segment"] is None:
            return torch.empty(shape, dtype=dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        buffer = self._mapping(descriptor["segment"])
        start = descriptor["offset"]
        return buffer[start : start + nbytes].view(dtype).view(shape)

    def copy(self, descriptor: dict[str, Any]) -> torch.Tensor:
        """A private copy, safe to keep."""
        return self.view(descriptor).clone()

    def _mapping(self, name: str) -> torch.Tensor:
        if name not in self._maps:
            path = _segment_path(name)
            if not os.path.exists(path):
                raise RuntimeError(f"shared-memory segment {name} is gone; its sender stopped or moved on")
            self._maps[name] = _map_segment(name, os.path.getsize(path), shared=self._shared)
        return self._maps[name]

    def forget_except(self, names: set[str]) -> None:
        """Drop cached mappings not in ``names`` (an outgrown arena's memory is freed once no view remains)."""
        for name in list(self._maps):
            if name not in names:
                del self._maps[name]

    def close(self) -> None:
        self._maps.clear()


def pack_handed_over(values: dict[str, Any], name: str) -> dict[str, Any]:
    """``values`` with its tensors copied into a new segment of their own (``name``) that the receiver takes over
    with ``take_handed_over``; other values pass as they are. The sender keeps no mapping and never writes the
    segment again, so it can go on at once however late the receiver reads (a streaming chunk, sent while the
    next one is computed)."""
    tensors = [value for value in values.values() if isinstance(value, torch.Tensor)]
    writer = ShmWriter(name, tracked=False)
    writer.reserve(tensors)
    packed = {key: {"__tensor__": writer.pack(value)} if isinstance(value, torch.Tensor) else value
              for key, value in values.items()}
    writer.release()
    return packed


def take_handed_over(packed: dict[str, Any]) -> dict[str, Any]:
    """The values of a ``pack_handed_over`` message, its tensors copied out; their segment is unlinked."""
    reader = ShmReader()
    values = {key: reader.copy(value["__tensor__"]) if isinstance(value, dict) and "__tensor__" in value else value
              for key, value in packed.items()}
    reader.close()
    for name in segment_names(packed):
        try:
            os.unlink(_segment_path(name))
        except FileNotFoundError:
            pass
    return values


def segment_names(message_data: Any) -> set[str]:
    """The segments a plain-data message refers to."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "__tensor__" in value and isinstance(value["__tensor__"], dict):
                name = value["__tensor__"].get("segment")
                if name:
                    found.add(name)
                return
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(message_data)
    return found


class SegmentJanitor:
    """Driver-side owner of the segments its workers create: tracked from first sight, unlinked at the end."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._adopted: set[str] = set()

    def adopt(self, names: set[str]) -> None:
        for name in names - self._adopted:
            resource_tracker.register("/" + name, "shared_memory")
            self._adopted.add(name)

    def clean(self) -> None:
        """Unlink every segment of the pool generation (adopted or not) and balance the tracker."""
        remove_segments(self.prefix)
        for name in self._adopted:
            resource_tracker.unregister("/" + name, "shared_memory")
        self._adopted.clear()


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (after workers were killed); returns the names."""
    if not prefix or not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(_segment_path(name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


# -- Ray: raw bytes as numpy arrays in the object store ---------------------------------------------------


def pack_for_ray(tensor: torch.Tensor) -> dict[str, Any]:
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return {"bytes": raw.numpy(), "dtype": _dtype_name(tensor), "shape": list(tensor.shape)}


def unpack_from_ray(descriptor: dict[str, Any]) -> torch.Tensor:
    # Arrays from the object store are read-only views of shared memory: copy before handing them out.
    raw = torch.from_numpy(np.array(descriptor["bytes"], copy=True))
    return raw.view(DTYPES[descriptor["dtype"]]).view(descriptor["shape"])
