"""The WanMesh Cache node: step-caching settings for the WanMesh Sampler and the WanMesh Native Model."""

from __future__ import annotations

from ..parallel.fields import node_input
from ..parallel.cache_settings import CacheSettings, cache_fields, check_cache

CATEGORY = "WanMesh/sampling"


class WanMeshCache:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "method": node_input("cache_method"),
            "threshold": node_input("cache_threshold"),
            "start_percent": node_input("cache_start"),
            "end_percent": node_input("cache_end"),
            "max_skips": node_input("cache_max_skips"),
            "coefficients": node_input("cache_coefficients"),
        }}

    RETURN_TYPES = ("WANMESH_CACHE",)
    FUNCTION = "make"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Step caching (TeaCache, MagCache, first-block cache) for the WanMesh Sampler and the WanMesh "
                   "Native Model: steps whose transformer input barely changes reuse the last computed residual. "
                   "Every parallel layout takes the same decisions as one GPU.")

    def make(self, method, threshold, start_percent, end_percent, max_skips, coefficients):
        settings = CacheSettings(method, threshold, start_percent, end_percent, max_skips, coefficients)
        check_cache(settings)
        return (cache_fields(settings),)
