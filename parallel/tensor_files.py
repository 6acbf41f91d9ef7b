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
