"""The WanMesh Sampler's ComfyUI path: ComfyUI's own samplers and schedulers on the pool MODEL; runs in ComfyUI.

Sampler and scheduler names that the workers implement run the whole loop on the pool (one request, see
``nodes/sampling.py``). Every other name in ComfyUI's lists runs here, with ComfyUI's code itself: its
``ModelSamplingSD3`` sets the shift and its KSampler routine (``nodes.common_ksampler``, what KSampler and
KSamplerAdvanced call) samples the MODEL of ``pool_model.py``, whose model calls run on the pool. Two experts are
two chained runs split where the timestep falls below the boundary, as native Wan 2.2 workflows chain them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .pool_model import pool_model
from .runtime import ResidentModel


@dataclass(frozen=True)
class ComfySampling:
    """The WanMesh Sampler's settings, as ComfyUI's KSampler routine takes them."""

    seed: int
    steps: int
    shift: float
    sampler_name: str
    scheduler: str
    denoise: float
    start_step: int
    end_step: int | None  # None: to the last step, the result fully denoised
    add_noise: bool


def comfy_model(resident: ResidentModel, shift: float):
    """The pool MODEL with ComfyUI's ModelSamplingSD3 shift applied (what Wan templates put before KSampler)."""
    model_sampling_sd3 = importlib.import_module("comfy_extras.nodes_model_advanced").ModelSamplingSD3
    return model_sampling_sd3().patch(pool_model(resident), shift)[0]


def expert_switch_step(model, settings: ComfySampling, boundary: float) -> int:
    """The first step whose timestep (sigma x 1000, ComfyUI's schedule) is below ``boundary`` x 1000: the
    high-noise expert runs the steps before it, the low-noise expert the rest (Wan 2.2's rule)."""
    samplers = importlib.import_module("comfy.samplers")
    sigmas = samplers.KSampler(model, steps=settings.steps, device="cpu", sampler=settings.sampler_name,
                               scheduler=settings.scheduler, denoise=settings.denoise).sigmas
    below = [step for step in range(settings.steps) if float(sigmas[step]) < boundary]
    return below[0] if below else settings.steps


def _run(model, cfg: float, positive, negative, latent: dict, settings: ComfySampling, start: int,
         last: int | None, add_noise: bool) -> dict:
    common_ksampler = importlib.import_module("nodes").common_ksampler  # ComfyUI's own KSampler routine
    return common_ksampler(model, settings.seed, settings.steps, cfg, settings.sampler_name, settings.scheduler,
                           positive, negative, latent, denoise=settings.denoise, disable_noise=not add_noise,
                           start_step=start, last_step=last, force_full_denoise=last is None)[0]


def sample_with_comfyui(model: ResidentModel, positive, negative, latent: dict, cfg: float,
                        settings: ComfySampling, model_low_noise: ResidentModel | None = None,
                        boundary: float = 0.0, cfg_low_noise: float | None = None) -> dict:
    """The sampled LATENT: one run on ``model``, or the high-noise expert then the low-noise one."""
    high = comfy_model(model, settings.shift)
    if model_low_noise is None:
        return _run(high, cfg, positive, negative, latent, settings, settings.start_step, settings.end_step,
                    settings.add_noise)
    last = settings.steps if settings.end_step is None else settings.end_step
    switch = min(max(expert_switch_step(high, settings, boundary), settings.start_step), last)
    if switch > settings.start_step:
        latent = _run(high, cfg, positive, negative, latent, settings, settings.start_step,
                      None if switch >= settings.steps and settings.end_step is None else switch, settings.add_noise)
    if switch < last:
        low = comfy_model(model_low_noise, settings.shift)
        add_noise = settings.add_noise and switch == settings.start_step
        latent = _run(low, cfg if cfg_low_noise is None else cfg_low_noise, positive, negative, latent, settings,
                      switch, settings.end_step, add_noise)
    return latent
