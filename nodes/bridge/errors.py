"""How WanMesh failures look in ComfyUI: a short exception name and a one-line cause with the rank and what to
do; the worker's traceback goes to the ComfyUI log. Runs in the ComfyUI process.

``present_errors`` wraps each node's FUNCTION once at registration, so the node files stay as they are.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from ...parallel import WorkerError

log = logging.getLogger("wanmesh")

POOL_STOPPED = ("WorkerDied", "Timeout", "StartTimeout")


class WanMeshWorkerError(RuntimeError):
    """A failure in the worker pool, as the node shows it."""


# ComfyUI names an exception by module and qualified name unless the module is 'builtins': so it reads
# "WanMeshWorkerError" in the UI instead of a long module path.
WanMeshWorkerError.__module__ = "builtins"


def advice(error: WorkerError) -> str:
    """What the user can do about a worker failure."""
    if error.error_type == "PoolStopped":
        return "queue the prompt again when the server is back"
    if error.error_type in POOL_STOPPED:
        if "pool was stopped" in error.message:  # the cause already says so (and that a fresh one starts)
            return "queue the prompt again (details in the ComfyUI log)"
        return "the pool was stopped; queue the prompt again to start a fresh one (details in the ComfyUI log)"
    if "OutOfMemory" in error.error_type:
        return "lower the size or frame count, set a VAE tile size, or split the model over more ranks (tp)"
    if not error.traceback.strip():  # nothing more was sent (a killed rank, a refusal): point to no traceback
        return "details in the ComfyUI log"
    where = f"rank {error.rank}'s" if error.rank is not None else "the worker's"
    return f"{where} traceback is in the ComfyUI log"


def user_message(error: WorkerError) -> str:
    """One line: where, what, and what to do."""
    where = f"rank {error.rank}" if error.rank is not None else "worker pool"
    cause = error.message.strip().splitlines()[0] if error.message.strip() else "(no message)"
    return f"{where}: {error.error_type}: {cause} — {advice(error)}"


def worker_error(error: WorkerError, node: str, extra: str = "") -> WanMeshWorkerError:
    """Log the whole report (with the worker traceback) and make the short exception the UI shows."""
    log.error("WanMesh %s failed: %s", node, error)
    return WanMeshWorkerError(user_message(error) + extra)


def present_errors(method, node: str):
    @functools.wraps(method)
    def run(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except WorkerError as error:
            raise worker_error(error, node) from None

    run.wanmesh_presents_errors = True
    return run


def install(node_classes: dict[str, type]) -> None:
    """Wrap every node's FUNCTION (once) so worker failures reach the UI as WanMeshWorkerError."""
    for node_id, cls in node_classes.items():
        method = getattr(cls, cls.FUNCTION)
        if not getattr(method, "wanmesh_presents_errors", False):
            setattr(cls, cls.FUNCTION, present_errors(method, node_id))


def keep_latents(latents) -> Path:
    """Save latents a failed decode would otherwise lose, in ComfyUI's output folder
    (``wanmesh_latents/``, tensor 'latents', raw Wan latents as the LATENT holds them)."""
    import folder_paths

    from ...parallel import save_tensors_atomic

    folder = Path(folder_paths.get_output_directory()) / "wanmesh_latents"
    return save_tensors_atomic({"latents": latents.float()}, folder / f"latents_{time.strftime('%Y%m%d-%H%M%S')}_"
                               f"{time.monotonic_ns() % 10**6:06d}.safetensors")
