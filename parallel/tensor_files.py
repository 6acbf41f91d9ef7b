"""Writing tensors to .safetensors files atomically; runs in the driver (the CLI, or ComfyUI's process).

Like ``video_io.write_video``: the tensors go to a hidden temporary file in the same folder, which is flushed,
fsync'ed and read back (every name with its shape) before it is renamed into place, so a full disk or a
crash never leaves a partial file under the final name. OS errors propagate unchanged.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch

from .video_io import fsync_file, fsync_folder


def save_tensors_atomic(tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``tensors`` (CPU copies, contiguous) to ``path``; nothing appears under ``path`` unless all of it did."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        save_file(cpu, str(temporary))
        fsync_file(temporary)
        _check_saved(temporary, {name: tuple(t.shape) for name, t in cpu.items()})
        os.replace(temporary, path)
        fsync_folder(path.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def _check_saved(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    from safetensors import safe_open

    if path.stat().st_size == 0:
        raise OSError(f"the tensor file {path} was written empty")
    with safe_open(str(path), framework="pt") as handle:
        found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    if found != shapes:
        raise OSError(f"reading {path} back gave tensors {found}; expected {shapes}")
