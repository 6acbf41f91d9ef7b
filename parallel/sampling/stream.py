"""Causal streaming sampling: chunk by chunk with a KV cache, as the released causal checkpoints sample; runs in
the workers.

The scheme (ComfyUI's native autoregressive sampler and the Self-Forcing reference):

* sigmas: ``stream_sigmas`` - the shift-warped "simple" schedule, 4 steps at shift 5 give
  [1, 0.9375, 0.8333, 0.625, 0]; the model's timestep is ``1000 * sigma``;
* sampling is in normalised latent space (``latents.py``) and the result is converted back to raw latents;
* the starting noise is drawn once from ``seed`` for the whole latent (CPU generator, as the ordinary loop and
  ComfyUI draw it); each chunk takes its own frames;
* per chunk and step: the flow prediction ``v`` gives the clean estimate ``x0 = x - sigma * v``; before the
  next step it is re-noised, ``x = (1 - sigma') * x0 + sigma' * eps`` with ``eps`` drawn from a CPU generator
  seeded with ``seed + 1000 * chunk + step`` (``step`` = 0-based index of the step just taken); no noise after
  the last step (its next sigma is 0);
* the cache is rolled back after each step (the chunk's K/V are never kept during its steps) and written for
  good by one extra forward at timestep 0 on the clean chunk; the last chunk's write is skipped (nothing reads
  it, the output is the same);
* the cross-attention K/V are computed once per prompt; a shorter last chunk is allowed;
* from a start image (ComfyUI's ARVideoI2V: the first image resized and centre-cropped bilinearly to the video's
  size, VAE-encoded to one latent frame): its latent frames are the first block, written to the cache by the
  timestep-0 pass and kept as given in the output; the chunks after it are generated (chunk index 1 on), their
  noise the whole latent's frames from there.

Where the references differ and what is followed here: Self-Forcing draws its re-noise with ``randn_like`` on
the device's global generator (not reproducible across devices), ComfyUI seeds it per chunk and step - this
follows ComfyUI. Self-Forcing's warped timesteps come from its 1000-entry scheduler table (the same values up to
float rounding). ComfyUI supports cfg 1 only; here a guidance scale != 1 runs the conditional and the
unconditional branch one after the other, each with its own KV cache (and its own write pass), combined as the
ordinary loop combines them. CFG parallel is refused (``config.check_stream_layout``). The rolling window
(``kv_window``, ``sink``) counts frames as Self-Forcing's ``local_attn_size`` / ``sink_size`` do (the window
includes the current chunk; sink frames stay pinned); ComfyUI's native sampler has no window (the default here).

Parallel layout (``plan`` = the worker's ``distributed.mesh.ParallelContext``, None = one device): a chunk's
tokens are split over the Ulysses group (``distributed/causal_sp.py``), tensor parallelism is already in the
model (its cache holds its heads); ring > 1 and CFG parallel are refused. ``on_chunk`` is called on EVERY rank
with the same finished chunk (callers that report to the driver use rank 0's call).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..cache_settings import check_stream_cache
from ..config import (check_prompt_switches, check_stream_layout, check_stream_options, check_stream_start_latent,
                      check_stream_timesteps, stream_chunks)
from ..errors import Cancelled
from ..networks.causal import CacheWindow, CausalWan, LocalAttention
from ..networks.wan_inputs import compute_dtype
from .guidance import combine_guidance
from .latents import check_finite, denormalize_latents, normalize_latents, seeded_noise

__all__ = ["renoise_seed", "sample_stream", "stream_sigmas"]

TRAIN_TIMESTEPS = 1000


def _shifted(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def stream_sigmas(steps: int, shift: float, timesteps: list[int] | None = None) -> list[float]:
    """The per-chunk sigmas, ending with 0. Without ``timesteps``: ComfyUI's "simple" schedule of ``steps`` steps
    for a flow model with this shift. With ``timesteps`` (decreasing, in 1..1000, as Self-Forcing's
    ``denoising_step_list``): those, warped by the shift (shift 1 keeps them as given); ``steps`` is then ignored."""
    if not (shift > 0 and shift < float("inf")):
        raise ValueError(f"shift must be a positive finite number, got {shift}")
    if timesteps is None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
        timesteps = [TRAIN_TIMESTEPS - int(i * TRAIN_TIMESTEPS / steps) for i in range(steps)]
    else:
        check_stream_timesteps(timesteps)
        timesteps = [float(t) for t in timesteps]
    return [_shifted(t / TRAIN_TIMESTEPS, shift) for t in timesteps] + [0.0]


def renoise_seed(seed: int, chunk_index: int, step: int) -> int:
    """The seed of the noise that re-noises chunk ``chunk_index`` after step ``step`` (0-based)."""
    return int(seed) + 1000 * chunk_index + step


def _attention_strategy(model, plan, fused_all_to_all: bool):
    """Local attention, or the Ulysses causal attention when the plan's ulysses degree is > 1."""
    if plan is None:
        return LocalAttention()
    check_stream_layout(ring=plan.size("ring"), cfg_parallel=plan.config.cfg_parallel)
    if plan.size("ulysses") == 1 or not plan.is_distributed:
        return LocalAttention()
    from ..distributed.causal_sp import UlyssesCausalAttention

    return UlyssesCausalAttention(model, plan.ulysses_group, fused_all_to_all=fused_all_to_all)


def _check_inputs(latent_shape, sigmas, positive, negative, guidance_scale) -> None:
    if len(latent_shape) != 5:
        raise ValueError(f"latent_shape must be (B, 16, T, h, w), got {tuple(latent_shape)}")
    if len(sigmas) < 2 or sigmas[-1] != 0.0:
        raise ValueError(f"sigmas must hold at least one step and end with 0 (see stream_sigmas), got {sigmas}")
    if positive.ndim != 3 or positive.shape[0] != latent_shape[0]:
        raise ValueError(f"positive must be [B={latent_shape[0]}, L, D], got {tuple(positive.shape)}")
    if guidance_scale != 1.0 and negative is None:
        raise ValueError(f"guidance_scale={guidance_scale} needs a negative context; give one or use guidance 1")


def sample_stream(
    model, *, positive: torch.Tensor, negative: torch.Tensor | None, latent_shape: tuple[int, ...], seed: int,
    sigmas: list[float], chunk: int, kv_window: int | None = None, sink: int = 0, reanchor: bool = False,
    use_cache: bool = True, guidance_scale: float = 1.0, plan=None, on_chunk: Callable | None = None, should_stop: Callable | None = None,
    progress: Callable | None = None, fused_all_to_all: bool = True, stats: dict | None = None,
    start_latent: torch.Tensor | None = None, step_cache=None, prompt_switches: dict[int, torch.Tensor] | None = None,
    live_switch: Callable[[int], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Generate the whole latent chunk by chunk; returns raw latents [B, 16, T, h, w] (float32, CPU).

    ``positive``/``negative``: text contexts [B, L, D] (``loop.text_context``); ``negative`` is used only when
    ``guidance_scale != 1``. ``on_chunk(index, start_frame, raw_latents [B, 16, n, h, w])`` is called on every
    rank the moment a chunk is clean; ``should_stop()`` is polled before every step (raises ``Cancelled``);
    ``progress(done, total)`` follows every step, over all chunks. ``use_cache=False`` recomputes every earlier
    frame at every step (the reference). ``reanchor`` (with ``kv_window`` and ``sink``) keeps the pinned sink right
    before the window's oldest frame in time (``networks/causal.py``). ``fused_all_to_all=False`` runs the Ulysses split with three
    all-gathers instead of one all-to-all (the baseline the benchmark compares). ``stats``, a dict, receives
    ``chunk_seconds`` (time from the start to each finished chunk) and ``cache_bytes`` (this rank's KV cache).

    ``start_latent`` (raw [1 or B, 16, n, h, w], a start image's latents: streaming from an image, as ComfyUI's
    ARVideoI2V) is the first block: kept as given in the output's first ``n`` frames, written to every branch's
    cache at timestep 0 and reported as chunk 0; the chunks after it are generated.

    ``step_cache`` (``cache_settings.CacheSettings``): step caching within each chunk (``step_cache.py``'s
    ``ChunkedStepCache``: the steps restart per chunk, the KV cache writes are never skipped; with ``use_cache``
    only); ``stats`` then
    also receives ``cache_report`` and ``cache_decisions`` (stream step -> computed).

    ``prompt_switches`` ({chunk index: positive context [B, L, D]}): the prompt changes before those chunks. The
    chunks before a switch are as without it; at the switch the positive branch's caches are rebuilt under the new
    prompt (``CausalWan.recache``: the earlier chunks the next one still sees written again, not dropped), so the
    scene moves on from the frames made so far; ``stats`` receives ``recached_chunks`` ({switch: chunks
    written}). ``live_switch(index)`` is asked before every later chunk that has no switch of its own (on every
    rank, in step): a positive context it returns (a prompt posted while the stream runs) is a switch there."""
    latent_shape = tuple(int(s) for s in latent_shape)
    _check_inputs(latent_shape, sigmas, positive, negative, guidance_scale)
    check_stream_options(latent_shape[2], chunk, kv_window, sink, reanchor, use_cache)
    check_stream_cache(step_cache, use_cache)
    start_frames = 0 if start_latent is None else check_stream_start_latent(start_latent, latent_shape, kv_window, sink)
    switches = dict(prompt_switches or {})
    check_prompt_switches(sorted(switches), latent_shape[2], chunk, start_frames)
    strategy = _attention_strategy(model, plan, fused_all_to_all)
    _check_model(model)
    device, dtype = next(model.parameters()).device, compute_dtype(model)
    branches = [("positive", positive.to(device=device, dtype=dtype))]
    if guidance_scale != 1.0:
        branches.append(("negative", negative.to(device=device, dtype=dtype)))
    noise = seeded_noise(latent_shape, seed)
    clean = torch.zeros(latent_shape)
    chunks = stream_chunks(latent_shape[2], chunk, start_frames)
    steps = len(sigmas) - 1
    seeded = 1 if start_frames else 0  # the start image's block takes no steps
    total_steps = (len(chunks) - seeded) * steps
    timer = _ChunkTimer(stats, device)
    with torch.no_grad(), CausalWan(model, latent_shape, chunk, CacheWindow(kv_window, sink, reanchor), use_cache,
                                    strategy, start_frames=start_frames) as causal, \
            _chunk_cache(step_cache, causal, plan, strategy, steps) as cache:
        for index, (start, count) in enumerate(chunks):
            if live_switch is not None and index > 0 and index not in switches:
                posted = live_switch(index)
                if posted is not None:
                    switches[index] = posted
            if index in switches:
                cache.outside_steps()
                branches[0] = ("positive", switches[index].to(device=device, dtype=dtype))
                earlier = [(first, clean[:, :, first : first + n]) for first, n in chunks[:index]]  # views
                rewritten = causal.recache(branches[0][1], earlier, start + count)
                if stats is not None:
                    stats.setdefault("recached_chunks", {})[index] = rewritten
            cache.start_chunk(index)
            if start_frames and index == 0:
                x = normalize_latents(start_latent.float().expand(latent_shape[0], -1, -1, -1, -1)).to(device)
            else:
                before = clean[:, :, :start].to(device=device, dtype=dtype) if not use_cache else None

                def predict(x: torch.Tensor, sigma: float) -> torch.Tensor:
                    outputs = [causal.predict(x.to(dtype), start, TRAIN_TIMESTEPS * sigma, context, before,
                                              branch=name).float() for name, context in branches]
                    return outputs[0] if len(outputs) == 1 else combine_guidance(outputs[0], outputs[1], guidance_scale)

                def step_done(step: int) -> None:
                    if progress is not None:
                        progress((index - seeded) * steps + step + 1, total_steps)

                x = _denoise_chunk(predict, noise[:, :, start : start + count].to(device), sigmas, seed, index,
                                   f"chunk {index + 1} of {len(chunks)}", should_stop, step_done,
                                   lambda step: cache.at_step(step, len(branches)))
            clean[:, :, start : start + count] = x.cpu()
            if index + 1 < len(chunks):
                cache.outside_steps()
                for name, context in branches:
                    causal.write(x.to(dtype), start, context, branch=name)
            timer.chunk_done(causal)
            if on_chunk is not None:
                on_chunk(index, start, _raw(clean, start, count, start_latent))
    if stats is not None and step_cache is not None:
        stats.update(cache_report=cache.report(), cache_decisions=cache.decisions())
    return _raw(clean, 0, latent_shape[2], start_latent)


class _NoCache:
    """Stands in for the step cache when a stream runs without one."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start_chunk(self, index: int) -> None:
        pass

    def at_step(self, step: int, passes: int) -> None:
        pass

    def outside_steps(self) -> None:
        pass


def _chunk_cache(settings, causal: CausalWan, plan, strategy, steps: int):
    """The stream's step cache (installed inside ``CausalWan``, so its first-block hook sees the chunk after the
    sequence split): sums all-reduced over the Ulysses ranks, whose shard gives the real tokens."""
    if settings is None:
        return _NoCache()
    from .step_cache import ChunkedStepCache, Reduction, StepCache

    split = plan is not None and plan.is_distributed and plan.size("ulysses") > 1
    reduction = Reduction((plan.ulysses_group,) if split else ())
    cache = StepCache(settings, causal.model, reduction, steps, causal.rope.tokens_per_frame,
                      shard=(lambda: strategy.shard) if split else None)
    return ChunkedStepCache(cache, steps)


def _raw(clean: torch.Tensor, start: int, count: int, start_latent: torch.Tensor | None) -> torch.Tensor:
    """Raw latents of frames ``start .. start+count``; the start image's frames exactly as given (no round trip
    through the normalisation)."""
    raw = denormalize_latents(clean[:, :, start : start + count])
    if start_latent is not None and start < start_latent.shape[2]:
        kept = min(start_latent.shape[2] - start, count)
        raw[:, :, :kept] = start_latent[:, :, start : start + kept].float()
    return raw


def _check_model(model) -> None:
    if getattr(getattr(model, "config", None), "vace_layers", None) is not None:
        raise ValueError("streaming runs Wan text-to-video models; this is a VACE model (VACE-conditioned streaming "
                         "is not supported): load the T2V model without a VACE module")
    if getattr(model, "audio_proj", None) is not None:
        raise ValueError("streaming runs Wan text-to-video models; this is a HuMo model, whose audio streaming does "
                         "not take: sample it in ComfyUI with WanHuMoImageToVideo")


class _ChunkTimer:
    """Fills the caller's ``stats`` dict: seconds to each finished chunk (from the start), and the KV cache bytes
    this rank holds (all blocks and branches; with Ulysses / tp only this rank's heads): the largest, and after
    each chunk (``chunk_cache_bytes``)."""

    def __init__(self, stats: dict | None, device: torch.device):
        self.stats, self.device = stats, device
        self.start = time.perf_counter()
        if stats is not None:
            stats.update(chunk_seconds=[], cache_bytes=0, chunk_cache_bytes=[])

    def chunk_done(self, causal: CausalWan) -> None:
        if self.stats is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats["chunk_seconds"].append(time.perf_counter() - self.start)
        held = causal.cache_bytes()
        self.stats["chunk_cache_bytes"].append(held)
        self.stats["cache_bytes"] = max(self.stats["cache_bytes"], held)


def _denoise_chunk(predict: Callable, x: torch.Tensor, sigmas: list[float], seed: int, index: int, name: str,
                   should_stop: Callable | None, step_done: Callable[[int], None],
                   step_begins: Callable[[int], None]) -> torch.Tensor:
    """Every step of chunk ``index`` from its noise ``x``; ``should_stop`` polled before each (``Cancelled``),
    ``step_begins(step)`` told before its model calls."""
    for step in range(len(sigmas) - 1):
        if should_stop is not None and should_stop():
            raise Cancelled(f"streaming cancelled before step {step + 1} of {name}")
        step_begins(step)
        x = _denoise_step(predict, x, sigmas, step, renoise_seed(seed, index, step))
        step_done(step)
    return x


def _denoise_step(predict: Callable, x: torch.Tensor, sigmas: list[float], step: int, noise_seed: int) -> torch.Tensor:
    """One step: predict the clean chunk, then re-noise it to the next sigma (nothing at the last, sigma 0)."""
    sigma, next_sigma = sigmas[step], sigmas[step + 1]
    clean = x - sigma * predict(x, sigma)
    check_finite(clean, step + 1, len(sigmas) - 1)
    if next_sigma == 0.0:
        return clean
    return (1.0 - next_sigma) * clean + next_sigma * seeded_noise(tuple(x.shape), noise_seed).to(x.device)
