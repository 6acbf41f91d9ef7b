"""The WanMesh Pool node: the shape of the background worker pool that every connected loader uses."""

from __future__ import annotations

import logging

from ..parallel import ParallelConfig, PoolRunner, check_ranks
from ..parallel.config import DEFAULT_WORKER_TIMEOUT_S
from ..parallel.auto_layout import degrees_set
from ..parallel.fields import node_input
from .bridge.runtime import raise_if_interrupted

REQUIRED = ("devices", "world", "tp", "ulysses", "ring", "cfg_parallel", "vae_patch", "backend", "ray_address")
# Optional, after the required inputs: saved workflows keep their widget order, and API prompts written before
# these inputs existed still run with the defaults.
OPTIONAL = ("worker_timeout", "previews", "memory_budget_gb", "layout")


def _comfy_interrupt() -> bool:
    """ComfyUI's Cancel, raised as its own exception; nothing outside ComfyUI (tests that import the nodes)."""
    try:
        import comfy.model_management  # noqa: F401
    except ImportError:
        return False
    raise_if_interrupted()
    return False


# ComfyUI's Cancel also stops pool start and model loading (calls that have no cancel callback of their own).
PoolRunner.set_interrupt_check(_comfy_interrupt)


class WanMeshPool:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {name: node_input(name) for name in REQUIRED},
                "optional": {name: node_input(name) for name in OPTIONAL}}

    RETURN_TYPES = ("WANMESH_POOL",)
    FUNCTION = "make"
    CATEGORY = "WanMesh/pool"
    DESCRIPTION = "Starts (or reuses) the background worker pool; connect it to the loaders."

    def make(self, devices, world, tp, ulysses, ring, cfg_parallel, vae_patch, backend, ray_address,
             worker_timeout=DEFAULT_WORKER_TIMEOUT_S, previews=True, memory_budget_gb=0.0, layout="manual"):
        check_auto_layout(layout, degrees_set(tp, ulysses, ring, vae_patch, cfg_parallel))
        config = ParallelConfig(
            world=world, tp=tp, ulysses=ulysses, ring=ring, cfg_parallel=cfg_parallel, vae_patch=vae_patch,
            devices=devices, backend=backend, ray_address=ray_address or None, worker_timeout=float(worker_timeout),
            memory_budget_gb=float(memory_budget_gb),
        )
        for warning in check_ranks(config):  # a bad device list fails here, before the live pool is replaced
            logging.getLogger("wanmesh").warning("WanMesh Pool: %s", warning)
        return (PoolRunner.for_config(config, previews=previews, auto_layout=layout == "auto"),)


def check_auto_layout(layout: str, given: list[str]) -> None:
    """layout auto chooses every degree: degrees set as well are a mistake, refused before any worker starts."""
    if layout == "auto" and given:
        raise ValueError(f"layout auto chooses the degrees itself; set {', '.join(given)} back to 1 (off), or use "
                         "layout manual to set them")
