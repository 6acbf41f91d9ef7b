"""Where node work runs, and the handles that travel between nodes (WANMESH_MODEL, WANMESH_VAE, ...)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.engine import Engine

_default_engine: Engine | None = None


def default_runner() -> Engine:
    """The process-wide runner used when no pool is connected: one device, the first GPU if there is one."""
    global _default_engine
    if _default_engine is None:
        _default_engine = Engine("cuda" if torch.cuda.is_available() else "cpu")
    return _default_engine


@dataclass(frozen=True)
class Loaded:
    """A model resident in a runner; nodes pass this along instead of the model itself."""

    runner: Engine
    handle: str


def progress_reporter(total: int):
    """A progress(step, total) callback driving ComfyUI's progress bar."""
    import comfy.utils

    bar = comfy.utils.ProgressBar(total)
    return lambda step, steps: bar.update_absolute(step, steps)


def interrupted() -> bool:
    import comfy.model_management

    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    """Turn an engine cancel into ComfyUI's own interrupt exception."""
    import comfy.model_management

    comfy.model_management.throw_exception_if_processing_interrupted()
