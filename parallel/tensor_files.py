"""Writing tensors to .safetensors files atomically; runs in the driver (the CLI, or ComfyUI's process).

Through ``video_io.written_atomically``, as videos are: the tensors go to a hidden temporary file in the same
folder, which is read back (every name with its shape), fsync'ed and renamed into place, so a full disk or a
crash never leaves a partial file under the final name. OS errors propagate unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .video_io import written_atomically


def save_tensors_atomic(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (CPU copies, contiguous) and the header's ``metadata`` to ``path``; nothing appears under
    ``path`` unless all of it did."""
    from safetensors.torch import save_file

    path = Path(path)
    cpu = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    with written_atomically(path) as temporary:
        save_file(cpu, str(temporary), metadata=metadata)
        _check_saved(temporary, {name: tuple(t.shape) for name, t in cpu.items()})
    return path


def _check_saved(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    from safetensors import safe_open

    if path.stat().st_size == 0:
        raise OSError(f"the tensor file {path} was written empty")
    with safe_open(str(path), framework="pt") as handle:
        found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    if found != shapes:
        raise OSError(f"reading {path} back gave tensors {found}; expected {shapes}")


SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                     torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8"}


def save_tensors_streamed(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], make, path: str | Path,
                          metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file written one tensor at a time: ``entries`` are (name, dtype, shape) in file order and
    ``make(name)`` returns that tensor when its turn comes, so at most one tensor is in memory. Written by hand
    because safetensors' ``save_file`` takes every tensor at once: a real 14B file (27 GiB) would not fit this
    machine's memory. The format is the library's (8-byte header length, JSON header padded to 8 bytes, the data
    in offset order); the file is read back with safetensors and written atomically, as ``save_tensors_atomic``."""
    import json

    path = Path(path)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        size = dtype.itemsize
        for extent in shape:
            size *= extent
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with written_atomically(path) as temporary:
        with open(temporary, "wb") as file:
            file.write(len(encoded).to_bytes(8, "little"))
            file.write(encoded)
            for name, dtype, shape in entries:
                tensor = make(name)
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"{name}: made {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {shape}")
                file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        _check_saved(temporary, {name: tuple(shape) for name, _, shape in entries})
    return path
