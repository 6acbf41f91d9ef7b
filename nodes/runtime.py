"""Where node work runs, and the handles that travel between nodes (WANMESH_MODEL, WANMESH_VAE, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel import PoolRunner


def default_runner() -> PoolRunner:
    """The runner of loaders with no pool connected: the live pool, else a one-rank pool (first GPU, or CPU)."""
    return PoolRunner.current_or_single()


@dataclass(frozen=True)
class Loaded:
    """A model resident in a runner; nodes pass this along instead of the model itself."""

    runner: PoolRunner
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
