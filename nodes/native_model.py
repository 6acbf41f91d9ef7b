"""The WanMesh Native Model node: a WanMesh model (with its LoRAs) as ComfyUI's MODEL, for ComfyUI's own samplers."""

from __future__ import annotations

from .bridge.pool_model import pool_model

CATEGORY = "WanMesh/loaders"


class WanMeshNativeModel:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("WANMESH_MODEL", {
            "tooltip": "the loaded Wan T2V, VACE or image-to-video transformer (after any WanMesh LoRA Loader)"})},
                "optional": {"cache": ("WANMESH_CACHE", {"tooltip": "step caching (WanMesh Cache) over each "
                                                                    "sampler run's model calls"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = CATEGORY
    DESCRIPTION = ("ComfyUI's MODEL for a model in the worker pool: KSampler, KSamplerAdvanced, SamplerCustom"
                   "(Advanced), guiders, sigma nodes and ModelSamplingSD3 use it as a native Wan model from "
                   "UNETLoader; each model call runs on the pool with its parallel layout. LoRAs: ComfyUI's "
                   "LoraLoaderModelOnly after this node, or the WanMesh LoRA Loader before it.")

    def wrap(self, model, cache=None):
        return (pool_model(model, cache),)
