"""PoolRunner: the Engine's methods, run in the worker pool. The nodes and the command line both use it.

Requests are checked here, in the driver, before they are sent, so bad input fails before any worker work.
"""

from __future__ import annotations

import dataclasses

import torch

from . import protocol as P
from .config import ParallelConfig
from .pool import CallCancelled, WorkerPool, current_pool, get_pool
from .sampling import Cancelled, SampleRequest
from .vae_tiling import check_tiles
from .video import check_latent


class PoolRunner:
    """Engine-compatible facade over a WorkerPool (same method names and results)."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    @classmethod
    def for_config(cls, config: ParallelConfig) -> "PoolRunner":
        """The process-wide pool for this config (started, or restarted when the config changed)."""
        return cls(get_pool(config))

    @classmethod
    def current_or_single(cls) -> "PoolRunner":
        """The live pool if there is one (so unconnected loaders join it), else a one-rank pool."""
        pool = current_pool()
        return cls(pool) if pool is not None else cls.for_config(ParallelConfig(world=1, devices="auto"))

    @property
    def config(self) -> ParallelConfig:
        return self.pool.config

    def load_model(self, path: str, *, vace_module: str | None = None, dtype: str = "auto") -> str:
        return self.pool.call(P.LoadModel(path=path, vace_module=vace_module, dtype=dtype)).handle

    def load_vae(self, path: str, *, dtype: str = "auto") -> str:
        return self.pool.call(P.LoadVae(path=path, dtype=dtype)).handle

    def load_text_encoder(self, path: str, *, dtype: str = "auto") -> str:
        return self.pool.call(P.LoadTextEncoder(path=path, dtype=dtype)).handle

    def unload(self, handle: str | None = None) -> None:
        self.pool.call(P.Unload(handle=handle))

    def encode_text(self, handle: str, prompts: list[str]) -> list[torch.Tensor]:
        return self.pool.call(P.EncodeText(handle=handle, prompts=list(prompts))).embeddings

    def sample(self, handle: str, request: SampleRequest, progress=None, should_stop=None) -> torch.Tensor:
        request.validate()
        check_latent(request.latent)
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
        try:
            reply = self.pool.call(P.Sample(handle=handle, **fields), progress=progress, should_cancel=should_stop)
        except CallCancelled as cancelled:
            raise Cancelled(str(cancelled)) from cancelled
        return reply.latents

    def decode(self, handle: str, latents: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        check_tiles(tile_px, overlap_px)
        return self.pool.call(P.Decode(handle=handle, latents=latents, tile_px=tile_px, overlap_px=overlap_px)).images

    def encode(self, handle: str, frames: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        check_tiles(tile_px, overlap_px)
        return self.pool.call(P.Encode(handle=handle, frames=frames, tile_px=tile_px, overlap_px=overlap_px)).latents
