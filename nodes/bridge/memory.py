"""ComfyUI's "unload models" and "free memory" (POST /free) reach the WanMesh pool; runs in the ComfyUI process.

ComfyUI handles /free between prompts: "unload_models" (and "free_memory") call
``comfy.model_management.unload_all_models()``, and "free_memory" then calls ``PromptExecutor.reset()``
(dropping its caches). WanMesh wraps both once at import: the first unloads the pool's resident models while its
workers stay up (each rank frees its weights and hands the memory back; the next prompt pays the weight load, not
a pool start), the second closes the pool (the workers exit; the next prompt starts fresh ones). Without ComfyUI,
or without a live pool,
the hooks do nothing, and a failure in them is logged, never raised into ComfyUI.
"""

from __future__ import annotations

import functools
import logging
import sys

log = logging.getLogger("wanmesh")
MARK = "wanmesh_hook"


def _after(original, action, what: str):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            try:
                if action():
                    log.info("WanMesh: %s", what)
            except Exception as error:  # noqa: BLE001 - freeing memory must never break ComfyUI's loop
                log.warning("WanMesh: could not %s: %s", what, error)

    setattr(hooked, MARK, True)
    return hooked


def install() -> bool:
    """Wrap ComfyUI's unload and reset once; False when ComfyUI's modules are not loaded (e.g. the CLI)."""
    from ...parallel import stop_pool, unload_pool_models

    management = sys.modules.get("comfy.model_management")
    execution = sys.modules.get("execution")
    if management is None or execution is None or not hasattr(execution, "PromptExecutor"):
        return False
    # The only two places the pack patches ComfyUI. ComfyUI (2024 to 0.33) has no hook a custom node can
    # register for /free: its main loop calls these two functions for the unload_models and free_memory flags,
    # so wrapping them (once: MARK) stands in for that hook. Each wrapper runs ComfyUI's own code first.
    if not getattr(management.unload_all_models, MARK, False):
        management.unload_all_models = _after(management.unload_all_models, unload_pool_models,
                                              "unloaded the worker pool's models (its workers stay up; the next prompt loads its models again)")
    executor = execution.PromptExecutor
    if not getattr(executor.reset, MARK, False):
        executor.reset = _after(executor.reset, stop_pool, "stopped the worker pool")
    return True
