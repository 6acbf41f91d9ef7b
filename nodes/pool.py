"""The WanMesh Pool node: the shape of the background worker pool that every connected loader uses."""

from __future__ import annotations

from ..parallel import BACKENDS, ParallelConfig, PoolRunner

DEGREE = {"default": 1, "min": 1, "max": 64}


class WanMeshPool:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "devices": ("STRING", {"default": "auto", "tooltip": "auto, cpu:N, or a list such as cuda:0,1,2,3"}),
                "world": ("INT", {**DEGREE, "tooltip": "number of ranks (worker processes)"}),
                "tp": ("INT", {**DEGREE, "tooltip": "tensor-parallel degree"}),
                "ulysses": ("INT", {**DEGREE, "tooltip": "Ulysses sequence-parallel degree"}),
                "ring": ("INT", {**DEGREE, "tooltip": "ring-attention degree"}),
                "cfg_parallel": ("BOOLEAN", {"default": False, "tooltip": "run the conditional and unconditional passes on two halves of the pool"}),
                "vae_patch": ("INT", {**DEGREE, "tooltip": "ranks that share VAE tiles"}),
                "backend": (list(BACKENDS), {"tooltip": "local: processes on this machine; ray: actors on a Ray cluster"}),
                "ray_address": ("STRING", {"default": "", "tooltip": "Ray cluster address (ray backend; empty: auto)"}),
            },
            # Optional so that API prompts written before this input existed still run (previews on).
            "optional": {
                "previews": ("BOOLEAN", {"default": True,
                                         "tooltip": "show a small preview of the video being made at every sampler "
                                                    "step (cheap, no VAE); off sends no preview images"}),
            },
        }

    RETURN_TYPES = ("WANMESH_POOL",)
    FUNCTION = "make"
    CATEGORY = "WanMesh/pool"
    DESCRIPTION = "Starts (or reuses) the background worker pool; connect it to the loaders."

    def make(self, devices, world, tp, ulysses, ring, cfg_parallel, vae_patch, backend, ray_address, previews=True):
        config = ParallelConfig(
            world=world, tp=tp, ulysses=ulysses, ring=ring, cfg_parallel=cfg_parallel, vae_patch=vae_patch,
            devices=devices, backend=backend, ray_address=ray_address or None,
        )
        return (PoolRunner.for_config(config, previews=previews),)
