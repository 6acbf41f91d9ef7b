"""The per-request executors of one rank: text encoding, sampling, VAE decode and encode; runs in a worker.

``RankExecutor`` runs each request on the rank's resident models (``residency.py``) with the rank's share
of the work: its data-parallel batch rows, its half of the CFG passes, its VAE tiles. Without process
groups (``parallel=None``) it is the plain one-device path that the parallel paths are compared with.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref

import torch
import torch.distributed as dist

from ..config import LATENT_CHANNELS, MESH_DIMS, encode_geometry
from ..errors import Cancelled
from ..distributed.patch_parallel import effective_patch_size
from ..networks.frames import centre_crop, frames_to_pixels, pixels_to_frames
from ..networks.vae_tiling import decode_raw, spatial_factor, tiled_decode, tiled_encode
from ..networks.wan_inputs import compute_dtype
from ..protocol import SampleRequest
from ..sampling.guidance import guidance_for
from ..vace.encode import encode_vace
from ..sampling.loop import pad_to_wan_text_length, sample
from ..cache_settings import cache_settings, describe_report
from ..sampling.step_cache import Reduction, StepCache, StepCaches, check_same_decisions
from ..sampling.two_experts import expert_steps_report, low_noise_expert
from .residency import ResidentModels

__all__ = ["RankExecutor"]

log = logging.getLogger("wanmesh")
DEFAULT_PARALLEL_TILE_PX = 256  # tile edge when VAE work is spread over ranks and no tile size was given


def _dp_share(index: int, batch: int, dp: int) -> range:
    """The batch rows of data-parallel replica ``index``: contiguous, near-equal, bounds rounded up, so that
    replica 0 (rank 0 reports progress and previews) has a row even when batch < dp."""
    return range(-(-index * batch // dp), -(-(index + 1) * batch // dp))


class RankExecutor(ResidentModels):
    """This rank's resident models and the operations the nodes and the command line need."""

    def __init__(self, device: str | torch.device = "cpu", parallel=None):
        super().__init__(device, parallel)
        self._vae_groups: dict[int, object] = {}
        # model -> the cache of a driver-side sampler's calls (gone with the model when it is unloaded)
        self._call_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._row_groups: dict = {}  # (mesh dims, coordinates holding rows) -> this rank's group of them
        self.last_cache_report: dict = {}

    # -- work ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_text(self, handle: str, prompts: list[str]) -> list[torch.Tensor]:
        """One embedding per prompt, padded to Wan's 512 text tokens as the Wan reference does."""
        return [pad_to_wan_text_length(embedding) for embedding in self._get(handle, "text").encode(prompts)]

    @torch.no_grad()
    def sample(self, request: SampleRequest, progress=None, should_stop=None) -> torch.Tensor:
        """Raw latents for a request the driver has validated; model-specific inputs are checked here."""
        for handle in filter(None, (request.handle, request.handle_low)):
            self.apply_loras(handle, request.model_loras.get(handle, ()))
        model = self._get(request.handle, "model")
        low_model = low_noise_expert(self, request, model)
        check_conditioning(model, request)
        dtype = compute_dtype(model)
        rows = self._batch_rows(request.latent.shape[0])
        caches = self._sampling_caches(request, [model, low_model])
        with caches or contextlib.nullcontext():
            latents = sample(
                model, request, device=self.device, dtype=dtype, progress=progress, should_stop=should_stop, rows=rows,
                guidance=self._guidance(), preview=self._previewer(request, progress, rows), low_model=low_model,
                step_cache=caches,
            )
        if caches is not None:
            check_same_decisions(caches.decisions(), request.steps, self.device)
            self.last_cache_report = caches.report()
        return self._gather_batch(latents, request.latent.shape[0])

    def _sampling_caches(self, request: SampleRequest, models: list) -> StepCaches | None:
        """The step caches of a sampling run: decisions summed over the sequence ranks and the data-parallel
        replicas that hold rows (a replica without rows samples nothing); with CFG parallel the unconditional rank
        follows the conditional one."""
        self.last_cache_report = {}
        models = list({id(model): model for model in models if model is not None}.values())
        for model in models:
            self._drop_call_cache(model)  # a driver-side sampler's cache does not reach into this run
        settings = cache_settings(request.cache)
        if settings is None:
            return None
        batch, dp = request.latent.shape[0], self._degree("dp")
        groups = self._sequence_groups() + self._row_groups_of(("dp",), lambda i: len(_dp_share(i, batch, dp)) > 0)
        cfg = self._degree("cfg")
        reduction = Reduction(groups, self.parallel.cfg_group if cfg > 1 else None,
                              self.parallel.coord("cfg") if cfg > 1 else 0)
        return StepCaches([StepCache(settings, model, reduction, request.steps, _tokens_per_frame(request.latent),
                                     experts=len(models)) for model in models])

    def _row_groups_of(self, dims: tuple[str, ...], holds) -> tuple:
        """The groups over which the ranks holding other rows sum a decision's statistics, along the mesh ``dims``:
        their mesh groups when every rank holds rows (``holds(*coordinates)``), else one group of the ranks that
        hold rows (fewer rows than ranks; made once per pattern, by every rank together as torch requires; a rank
        without rows is in none and decides nothing); none when one rank holds them all. Every rank that holds
        rows then sums the same whole-batch statistic and takes the same decision as one device."""
        sizes = [self._degree(dim) for dim in dims]
        everyone = list(itertools.product(*map(range, sizes)))
        holding = tuple(coords for coords in everyone if holds(*coords))
        if len(holding) == len(everyone):
            return tuple(self.parallel.group(dim) for dim, size in zip(dims, sizes) if size > 1)
        if len(holding) <= 1:
            return ()
        key = (dims, holding)
        if key not in self._row_groups:
            axes = [MESH_DIMS.index(dim) for dim in dims]
            ranks = self.parallel.mesh.mesh.movedim(axes, list(range(-len(axes), 0))).reshape(-1, *sizes)
            enumeration = [[int(plane[coords]) for coords in holding] for plane in ranks]
            self._row_groups[key] = dist.new_subgroups_by_enumeration(enumeration)[0]
        return () if self._row_groups[key] is None else (self._row_groups[key],)

    def _sequence_groups(self) -> tuple:
        """The groups of ranks that hold other tokens of the same rows (Ulysses, ring)."""
        return tuple(self.parallel.group(dim) for dim in ("ulysses", "ring") if self._degree(dim) > 1)

    @torch.no_grad()
    def forward(self, request, should_stop=None) -> torch.Tensor:
        """One model call of a sampler in the driver's process (``protocol.ModelForward``): the flow prediction of
        every row. The CFG-parallel and data-parallel ranks split the rows (conditional and unconditional rows
        batched together land on different halves); every rank gets the whole result."""
        from ..sampling.forward import forward_rows, latent_channels

        if should_stop is not None and should_stop():
            raise Cancelled("the model call was cancelled before it started")
        self.apply_loras(request.handle, request.loras)
        model = self._get(request.handle, "model")
        check_text_width(model, "context", [request.context[0]])
        dtype = compute_dtype(model)
        batch = request.latent.shape[0]
        rows = self._replica_rows(batch)
        self._call_cache(model, request, batch)
        if len(rows):
            prediction = forward_rows(model, request, rows, dtype, self.device)
        else:  # a replica with no rows (fewer rows than replicas) only joins the gather
            prediction = request.latent.new_zeros((0, latent_channels(model), *request.latent.shape[2:]))
        self._log_call_cache(model, request)
        return self._gather_replicas(prediction, batch)

    def _call_cache(self, model, request, batch: int) -> None:
        """The step cache of a sampler in the driver's process, kept on the model between its calls: installed on
        the first call that asks for it, told each call's step (from the sampler's sigmas, else from the timestep),
        dropped by a call without it. Sums run over the ranks holding other rows (when every rank has rows) and
        other tokens, as one device sees the whole call."""
        settings = cache_settings(request.cache)
        cache = self._call_caches.get(model)
        if cache is not None and cache.settings != settings:
            self._drop_call_cache(model)
            cache = None
        if settings is None:
            return
        if cache is None:
            cache = StepCache(settings, model, Reduction(), request.cache_steps, _tokens_per_frame(request.latent))
            self._call_caches[model] = cache.install()
        dp, cfg = self._degree("dp"), self._degree("cfg")
        rows_groups = self._row_groups_of(
            ("cfg", "dp"), lambda j, i: len(_dp_share(j, len(_dp_share(i, batch, dp)), cfg)) > 0)
        cache.reduction = Reduction(self._sequence_groups() + rows_groups)
        cache.at_step(call_step(cache, request), request.cache_steps or None)

    def _log_call_cache(self, model, request) -> None:
        """After the last step's call of a sampler run, rank 0 logs the run's steps computed and skipped."""
        cache = self._call_caches.get(model)
        if cache is None or not request.cache_steps or cache.step != request.cache_steps - 1:
            return
        if self.parallel is None or self.parallel.rank == 0:
            log.info("WanMesh Native Model: %s", describe_report(cache.report()))

    def _drop_call_cache(self, model) -> None:
        cache = self._call_caches.pop(model, None)
        if cache is not None:
            cache.remove()

    def sample_latents(self, request: SampleRequest, progress=None, should_stop=None):
        """``sample`` as the protocol's reply, with the report of which steps each expert ran."""
        from ..protocol import Latents

        if not request.timings:
            latents = self.sample(request, progress=progress, should_stop=should_stop)
            return Latents(latents, expert_steps=expert_steps_report(request), cache_report=self.last_cache_report)
        from .timings import timed

        distributed = self.parallel is not None and self.parallel.is_distributed and self.parallel.world > 1
        rank = self.parallel.rank if self.parallel is not None else 0
        latents, rank_timings = timed(lambda clock: self.sample(request, progress=clock, should_stop=should_stop),
                                      progress, self.device, rank, distributed)
        return Latents(latents, expert_steps=expert_steps_report(request), rank_timings=rank_timings,
                       cache_report=self.last_cache_report)

    @torch.no_grad()
    def stream(self, request, progress=None, should_stop=None, live_prompt=None):
        """A streaming request (``protocol.StreamSample``): (raw latents, decoded frames or None); rank 0 sends each
        finished chunk with its progress (``streaming.py``); a step cache's report is kept in ``last_cache_report``.
        ``live_prompt()`` gives a prompt posted while it runs (the same on every rank), encoded here by the request's
        ``live_text_encoder``."""
        from .streaming import run_stream

        model = self._get(request.handle, "model")
        check_conditioning(model, request)
        vae = self._get(request.vae_handle, "vae") if request.vae_handle else None
        rank = self.parallel.rank if self.parallel is not None else 0
        self.last_cache_report = {}
        live = None
        if request.live_text_encoder is not None and live_prompt is not None:
            self._get(request.live_text_encoder, "text")  # a missing encoder fails before the first chunk

            def live() -> tuple[str, list[torch.Tensor]] | None:
                text = live_prompt()
                return None if text is None else (text, self.encode_text(request.live_text_encoder, [text]))

        latents, frames, self.last_cache_report = run_stream(
            model, vae, request, device=self.device, rank=rank, plan=self._stream_plan(), progress=progress,
            should_stop=should_stop, live_prompt=live)
        return latents, frames

    def _stream_plan(self):
        """The sequence-parallel layout of the causal model on this rank (None on one device)."""
        if self.parallel is None or not self.parallel.is_distributed or self.parallel.world == 1:
            return None
        return self.parallel

    def _previewer(self, request: SampleRequest, progress, rows: range):
        """Rank 0 keeps the step's preview and sends it with that step's progress (other ranks make none)."""
        rank = self.parallel.rank if self.parallel is not None else 0
        if not request.preview or progress is None or rank != 0 or not len(rows):
            return None
        return getattr(progress, "attach_preview", None)

    def _guidance(self):
        """CFG parallel: this rank's half of the guidance passes (the plain two-pass guidance otherwise)."""
        cfg_degree = self._degree("cfg")
        if cfg_degree == 1:
            return None
        return guidance_for(self.parallel.cfg_group, cfg_degree, self.parallel.coord("cfg"))

    def _batch_rows(self, batch: int) -> range:
        """The batch rows this data-parallel replica samples: contiguous, near-equal shares."""
        dp = self._degree("dp")
        if dp == 1:
            return range(batch)
        return _dp_share(self.parallel.coord("dp"), batch, dp)

    def _gather_batch(self, latents: torch.Tensor, batch: int) -> torch.Tensor:
        """Reassemble the whole batch from the data-parallel replicas (every replica gets it)."""
        dp = self._degree("dp")
        if dp == 1:
            return latents
        return self._gather_shares(latents, batch, dp, self.parallel.dp_group)

    def _gather_shares(self, share: torch.Tensor, total: int, degree: int, group) -> torch.Tensor:
        """The ``total`` rows that the ``degree`` ranks of ``group`` hold as ``_dp_share`` shares, on every rank."""
        # all_gather needs equal shapes: pad every share to the largest, then cut by the known row ranges.
        largest = -(-total // degree)
        padded = share.new_zeros((largest, *share.shape[1:]))
        padded[: share.shape[0]] = share
        pieces = [torch.empty_like(padded) for _ in range(degree)]
        dist.all_gather(pieces, padded.to(self.device).contiguous(), group=group)
        return torch.cat([piece[: len(_dp_share(i, total, degree))].cpu() for i, piece in enumerate(pieces)])

    def _replica_rows(self, batch: int) -> range:
        """The rows of a model call this rank runs: its data-parallel share, split again over the CFG-parallel
        pair (so a sampler's batched conditional and unconditional rows run side by side)."""
        rows = self._batch_rows(batch)
        cfg = self._degree("cfg")
        if cfg == 1:
            return rows
        mine = _dp_share(self.parallel.coord("cfg"), len(rows), cfg)
        return range(rows.start + mine.start, rows.start + mine.stop)

    def _gather_replicas(self, share: torch.Tensor, batch: int) -> torch.Tensor:
        """Reassemble a model call's rows from ``_replica_rows`` shares: the CFG pair first, then the replicas."""
        cfg = self._degree("cfg")
        if cfg > 1:
            share = self._gather_shares(share, len(self._batch_rows(batch)), cfg, self.parallel.cfg_group)
        return self._gather_batch(share, batch)

    def _tiling(self, tile_px: int | None):
        """(tile group, tile edge, whether this rank decodes tiles). The tile group is the first vae_patch ranks;
        a tile edge of None means whole frames on this rank."""
        size = 1
        if self.parallel is not None and self.parallel.is_distributed:
            size = effective_patch_size(self.parallel.config.vae_patch, self.parallel.world)
        if size == 1:
            return None, tile_px, True
        if size not in self._vae_groups:  # every rank runs every request, so all ranks create it together
            self._vae_groups[size] = dist.new_group(ranks=list(range(size)))
        return self._vae_groups[size], tile_px or DEFAULT_PARALLEL_TILE_PX, self.parallel.rank < size

    @torch.no_grad()
    def decode(self, handle: str, latents: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        """Raw latents [B, z, T, h, w] (z = the VAE's latent channels: 16 for Wan 2.1, 48 for Wan 2.2) -> frames
        [B*F, H, W, 3] in 0..1 on the first rank (None on the others); H, W are the latent's times the VAE's factor.

        With a tile edge (or vae_patch > 1) the frames are cut into overlapping tiles spread over the tile ranks.
        Pixels stay raw (tiles blended unclamped) and are clamped once, as they become frames."""
        vae = self._get(handle, "vae")
        if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
            raise ValueError(f"expected Wan latents [B, {vae.config.z_dim}, T, h, w], got shape {list(latents.shape)}")
        group, tile_px, takes_part = self._tiling(tile_px)
        if not takes_part:
            return None
        if tile_px is None:
            pixels = decode_raw(vae, latents.to(self.device, vae.dtype))
        else:
            pixels = tiled_decode(vae, latents, tile_px=tile_px, overlap_px=overlap_px, group=group)
        return None if pixels is None else pixels_to_frames(pixels)

    @torch.no_grad()
    def encode(self, handle: str, frames: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        """Frames [F, H, W, 3] in 0..1 -> raw latents [1, z, T, h, w] (the posterior mode, as Wan uses).

        As native VAEEncode, sizes that are not multiples of the VAE's spatial factor (8, or 16 for Wan 2.2) are cut
        around the centre (``frames.centre_crop``) and frames past the last 4k+1 are dropped
        (``config.encode_geometry``). Tiling works as in `decode`; the merged latents reach every
        tile rank."""
        vae = self._get(handle, "vae")
        if frames.ndim != 4:
            raise ValueError(f"expected frames [F, H, W, 3], got shape {list(frames.shape)}")
        frames = centre_crop(frames, spatial_factor(vae))  # then a multiple of 8 too: encode_geometry keeps it whole
        rows, cols, count = encode_geometry(frames.shape[2], frames.shape[1], frames.shape[0])
        pixels = frames_to_pixels(frames[:count, rows, cols])
        group, tile_px, takes_part = self._tiling(tile_px)
        if not takes_part:
            return None
        if tile_px is None:
            return vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode().float().cpu()
        return tiled_encode(vae, pixels, tile_px=tile_px, overlap_px=overlap_px, group=group).float().cpu()

    @torch.no_grad()
    def encode_vace(self, request) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """VACE inputs -> native (vace_frames, vace_mask, trim_latent), every VAE encode tiled like ``encode``."""
        vae = self._get(request.handle, "vae")
        if vae.config.z_dim != LATENT_CHANNELS:
            raise ValueError(f"VACE conditioning is made with the Wan 2.1 VAE ({LATENT_CHANNELS} latent channels); "
                             f"this VAE has {vae.config.z_dim}: load the Wan 2.1 VAE for VACE")
        if not self._tiling(request.tile_px)[2]:
            return None  # not a tile rank: the tile ranks encode together, rank 0 answers

        def encode_frames(frames: torch.Tensor) -> torch.Tensor:
            return self.encode(request.handle, frames, request.tile_px, request.overlap_px)

        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
        encoding = encode_vace(encode_frames, request.width, request.height, request.length, mean,
                               request.control_video, request.control_masks, request.reference_images)
        return encoding.frames, encoding.mask, encoding.trim_latent


def _tokens_per_frame(latent: torch.Tensor) -> int:
    """The transformer's tokens per latent frame (Wan's 2 x 2 patches)."""
    return -(-latent.shape[-2] // 2) * -(-latent.shape[-1] // 2)


def call_step(cache: StepCache, request) -> int:
    """The step of a model call: the sampler's when the request carries it, else a new step for each new timestep
    (a larger one starts a new run)."""
    t = float(request.timestep.max())
    last = getattr(cache, "last_timestep", None)
    cache.last_timestep = t
    if request.cache_step >= 0:
        return request.cache_step
    if last is None or t > last:
        return 0
    return cache.step + (t != last)


def check_conditioning(model, request: SampleRequest) -> None:
    """Fail before sampling when the prompt embeddings cannot feed this model."""
    for name, embeddings in (("positive", request.positive), ("negative", request.negative)):
        check_text_width(model, name, embeddings)


def check_text_width(model, name: str, embeddings) -> None:
    """Each prompt embedding [L, D] has the model's text width D."""
    text_dim = model.config.text_dim
    for emb in embeddings:
        if emb.ndim != 2 or emb.shape[1] != text_dim:
            raise ValueError(
                f"{name} conditioning has shape {list(emb.shape)} but this model takes text embeddings of width "
                f"{text_dim}; encode the prompt with the text encoder that belongs to the model"
            )
