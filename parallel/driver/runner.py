"""PoolRunner: what the nodes and the command line call; runs in the driver (ComfyUI or CLI) process.

Each method checks its request here, in the driver, before it is sent, so bad input fails before any worker
work; then one pool call runs it on every rank (``worker/executors.py``) and rank 0's result comes back.
"""

from __future__ import annotations

import torch

from .. import protocol as P
from ..config import ParallelConfig, check_encode_frames, check_stream_layout, check_tiles
from ..vace.encode import check_encode_inputs
from .pool import WorkerPool, current_pool, get_pool, set_interrupt_check


class PoolRunner:
    """The pool's operations as methods: load, encode text, sample, decode, encode."""

    def __init__(self, pool: WorkerPool, previews: bool = True, follows_live: bool = False,
                 auto_layout: bool = False):
        self._pool = pool
        # Whether samplers using this runner ask rank 0 for per-step preview images (not part of the pool's
        # config: turning previews off or on keeps the running pool).
        self.previews = previews
        # Whether samplers arrange the pool for each job (the Pool node's layout auto; ``arrange``).
        self.auto_layout = auto_layout
        # The auto layout's choice per (model file, latent size per row), made at the first model call of
        # ComfyUI's own samplers (nodes/bridge/pool_model.py), which keep it for that size.
        self.call_layouts: dict[tuple, ParallelConfig] = {}
        self._follows_live = follows_live  # a closed pool is replaced by the live one, not by its own config's

    @classmethod
    def for_config(cls, config: ParallelConfig, previews: bool = True, auto_layout: bool = False) -> "PoolRunner":
        """The process-wide pool for this config (replaced when the config changed); its workers start with the
        first request, so what the loaders refuse from file headers (a head split, a width) starts none."""
        return cls(get_pool(config, start=False), previews=previews, auto_layout=auto_layout)

    @classmethod
    def current_or_single(cls) -> "PoolRunner":
        """The live pool if there is one (so unconnected loaders join it), else a one-rank pool."""
        return cls(_live_or_single_pool(), follows_live=True)

    @property
    def pool(self) -> WorkerPool:
        """The pool, never a closed one. A runner held by a cache (ComfyUI keeps node outputs) may outlive its pool
        (replaced by another Pool node's config, stopped by "free memory"): it then gets the process-wide pool of
        the same settings (the live pool, for loaders with no Pool node), which knows the models the closed pool
        had loaded and loads them again on first use."""
        if self._pool.closed:
            closed = self._pool
            self._pool = _live_or_single_pool() if self._follows_live else get_pool(closed.config, **closed.options)
            self._pool.adopt_loads(closed)
        return self._pool

    @staticmethod
    def set_interrupt_check(check) -> None:
        """Register the host's interrupt (returns True or raises its own exception); every pool call that is
        given no cancel callback polls it, so pool start and model loading stop on it too."""
        set_interrupt_check(check)

    @property
    def config(self) -> ParallelConfig:
        return self.pool.config

    def load_model(self, path: str, *, vace_module: str | None = None, dtype: str = "auto", weights: str = "keep") -> str:
        return self._load(P.LoadModel(path=path, vace_module=vace_module, dtype=dtype, weights=weights))

    def load_vae(self, path: str, *, dtype: str = "auto") -> str:
        return self._load(P.LoadVae(path=path, dtype=dtype))

    def load_text_encoder(self, path: str, *, dtype: str = "auto") -> str:
        return self._load(P.LoadTextEncoder(path=path, dtype=dtype))

    def _load(self, request) -> str:
        request.validate()  # before the pool starts
        return self.pool.call(request).handle

    def calibrate(self) -> list[dict]:
        """Each rank's speed, free memory and link figures, measured by the pool's workers at once."""
        return self.pool.call(P.Calibrate()).ranks

    def arrange(self, config: ParallelConfig) -> None:
        """Run on a pool of ``config`` from now on (the auto layout's choice): the process-wide pool is restarted
        with it, knowing the models the old one had loaded (they load again on first use); nothing changes when
        the pool already has this config."""
        if self.pool.config == config:
            return
        old = self._pool
        self._pool = get_pool(config, **old.options)
        self._pool.adopt_loads(old)
        if not old.closed:
            old.close()

    def unload(self, handle: str | None = None) -> None:
        self.pool.call(P.Unload(handle=handle))

    def encode_text(self, handle: str, prompts: list[str]) -> list[torch.Tensor]:
        return self.pool.call(P.EncodeText(handle=handle, prompts=list(prompts))).embeddings

    def sample(self, request: P.SampleRequest, progress=None, should_stop=None) -> torch.Tensor:
        """Raw latents; raises ``Cancelled`` when ``should_stop`` asked the workers to stop."""
        return self.sample_reply(request, progress=progress, should_stop=should_stop).latents

    def sample_reply(self, request: P.SampleRequest, progress=None, should_stop=None) -> P.Latents:
        """The sampling reply: raw latents and which steps each expert ran (``expert_steps``)."""
        request.validate()
        return self.pool.call(request, progress=progress, should_cancel=should_stop)

    def forward(self, request: P.ModelForward, should_stop=None) -> torch.Tensor:
        """One model call of a sampler that runs here (ComfyUI's samplers on the WanMesh MODEL): the flow
        prediction [B, 16, T, h, w]; raises ``Cancelled`` when ``should_stop`` asked the workers to stop."""
        request.validate()
        return self.pool.call(request, should_cancel=should_stop).latents

    def stream(self, request: P.StreamSample, on_chunk=None, progress=None, should_stop=None, live=None) -> P.Streamed:
        """A streaming run: the whole latent (and frames with a VAE); ``on_chunk(StreamChunk)`` gets each finished
        chunk as soon as rank 0 sends it, ``progress(step, total)`` every step. Raises ``Cancelled`` on cancel
        (chunks already delivered stay delivered). ``live`` (``live_prompts.LivePrompts``, with the request's
        ``live_text_encoder``): prompts posted while it runs, each applied at the next chunk boundary."""
        from .stream_chunks import chunk_progress

        request.validate()
        check_stream_layout(ring=self.config.ring, cfg_parallel=self.config.cfg_parallel)
        if live is not None and request.live_text_encoder is None:
            raise ValueError("live prompts need the stream's live_text_encoder (the loaded text encoder's handle)")

        def on_event(event: dict) -> None:
            if live is not None and P.LIVE_PROMPT_EVENT in event:
                live.applied(event[P.LIVE_PROMPT_EVENT])

        return self.pool.call(request, progress=chunk_progress(on_chunk, progress, on_event),
                              should_cancel=should_stop, live_inputs=None if live is None else live.take_new)

    def decode(self, handle: str, latents: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        check_tiles(tile_px, overlap_px, decode=True)
        return self.pool.call(P.Decode(handle=handle, latents=latents, tile_px=tile_px, overlap_px=overlap_px)).images

    def encode(self, handle: str, frames: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        check_tiles(tile_px, overlap_px)
        if frames.ndim == 4:
            check_encode_frames(frames.shape[2], frames.shape[1], frames.shape[0])
        return self.pool.call(P.Encode(handle=handle, frames=frames, tile_px=tile_px, overlap_px=overlap_px)).latents

    def encode_vace(self, request: P.EncodeVace) -> P.VaceEncoded:
        """Native VACE conditioning tensors; the inputs are checked here before any worker work."""
        check_tiles(request.tile_px, request.overlap_px)
        check_encode_inputs(request.width, request.height, request.length, request.control_video,
                            request.control_masks, request.reference_images)
        return self.pool.call(request)


def _live_or_single_pool() -> WorkerPool:
    return current_pool() or get_pool(ParallelConfig(world=1, devices="auto"))
