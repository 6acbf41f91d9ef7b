"""The WanMesh Pool node: the shape of the background worker pool that every connected loader uses."""

from __future__ import annotations

import logging

from ..parallel import BACKENDS, ParallelConfig, PoolRunner, check_ranks
from ..parallel.config import DEFAULT_WORKER_TIMEOUT_S, MIN_WORKER_TIMEOUT_S
from .runtime import raise_if_interrupted

DEGREE = {"default": 1, "min": 1, "max": 64}



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
        return {
            "required": {
                "devices": ("STRING", {"default": "auto", "tooltip": "auto, cpu:N, or a list such as cuda:0,1,2,3 (the machine's GPU numbers, as nvidia-smi lists them)"}),
                "world": ("INT", {**DEGREE, "tooltip": "number of ranks (worker processes)"}),
                "tp": ("INT", {**DEGREE, "tooltip": "tensor-parallel degree"}),
                "ulysses": ("INT", {**DEGREE, "tooltip": "Ulysses sequence-parallel degree"}),
                "ring": ("INT", {**DEGREE, "tooltip": "ring-attention degree"}),
                "cfg_parallel": ("BOOLEAN", {"default": False, "tooltip": "run the conditional and unconditional passes on two halves of the pool"}),
                "vae_patch": ("INT", {**DEGREE, "tooltip": "ranks that share VAE tiles"}),
                "backend": (list(BACKENDS), {"tooltip": "local: processes on this machine; ray: actors on a Ray cluster"}),
                "ray_address": ("STRING", {"default": "", "tooltip": "Ray cluster address (ray backend; empty: auto)"}),
            },
            # Optional, after the required inputs: saved workflows keep their widget order, and API prompts
            # written before these inputs existed still run with the defaults.
            "optional": {
                "worker_timeout": ("FLOAT", {
                    "default": DEFAULT_WORKER_TIMEOUT_S, "min": MIN_WORKER_TIMEOUT_S, "max": 86400.0, "step": 1.0,
                    "tooltip": "seconds a worker may stop answering (or wait in a collective) before the pool names "
                               "it, stops and restarts on next use; raise it for very slow models",
                }),
                "previews": ("BOOLEAN", {"default": True,
                                         "tooltip": "show a small preview of the video being made at every sampler "
                                                    "step (cheap, no VAE); off sends no preview images"}),
                "memory_budget_gb": ("FLOAT", {
                    "default": 0.0, "min": 0.0, "max": 4096.0, "step": 0.5,
                    "tooltip": "GB of model weights each rank keeps resident; loading past it unloads the least "
                               "recently used models. 0 = auto (what the device can hold)",
                }),
            },
        }

    RETURN_TYPES = ("WANMESH_POOL",)
    FUNCTION = "make"
    CATEGORY = "WanMesh/pool"
    DESCRIPTION = "Starts (or reuses) the background worker pool; connect it to the loaders."

    def make(self, devices, world, tp, ulysses, ring, cfg_parallel, vae_patch, backend, ray_address,
             worker_timeout=DEFAULT_WORKER_TIMEOUT_S, previews=True, memory_budget_gb=0.0):
        config = ParallelConfig(
            world=world, tp=tp, ulysses=ulysses, ring=ring, cfg_parallel=cfg_parallel, vae_patch=vae_patch,
            devices=devices, backend=backend, ray_address=ray_address or None, worker_timeout=float(worker_timeout),
            memory_budget_gb=float(memory_budget_gb),
        )
        for warning in check_ranks(config):  # a bad device list fails here, before the live pool is replaced
            logging.getLogger("wanmesh").warning("WanMesh Pool: %s", warning)
        return (PoolRunner.for_config(config, previews=previews),)
