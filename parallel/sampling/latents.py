"""Wan latent space: the raw <-> normalised conversion and the seeded starting noise; runs in the workers.

Latents enter and leave the pack as raw Wan VAE latents, as ComfyUI's native Wan nodes hold them; the denoising loop and the VACE context
work on latents normalised with the latent mean/std of their VAE, told apart by the channel count: the Wan 2.1 VAE's
16 channels (taken from diffusers' AutoencoderKLWan defaults) or the Wan 2.2 VAE's 48 (``config.WAN22_LATENTS_*``).
"""

from __future__ import annotations

import inspect

import torch
from diffusers import AutoencoderKLWan

from ..config import LATENT_CHANNEL_COUNTS, WAN22_LATENT_CHANNELS, WAN22_LATENTS_MEAN, WAN22_LATENTS_STD


def _wan_latent_stats() -> tuple[torch.Tensor, torch.Tensor]:
    """Wan 2.1 latent mean/std, taken from diffusers' AutoencoderKLWan defaults (the released VAE's values)."""
    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    mean = torch.tensor(params["latents_mean"].default, dtype=torch.float32).view(1, -1, 1, 1, 1)
    std = torch.tensor(params["latents_std"].default, dtype=torch.float32).view(1, -1, 1, 1, 1)
    return mean, std


LATENTS_MEAN, LATENTS_STD = _wan_latent_stats()
WAN22_MEAN = torch.tensor(WAN22_LATENTS_MEAN, dtype=torch.float32).view(1, -1, 1, 1, 1)
WAN22_STD = torch.tensor(WAN22_LATENTS_STD, dtype=torch.float32).view(1, -1, 1, 1, 1)


def latent_stats(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, C, 1, 1, 1] of the latent space with ``channels`` channels (16: Wan 2.1 VAE, 48: Wan 2.2)."""
    if channels == WAN22_LATENT_CHANNELS:
        return WAN22_MEAN, WAN22_STD
    if channels != LATENTS_MEAN.shape[1]:
        raise ValueError(f"latents have {channels} channels; valid: {' or '.join(map(str, LATENT_CHANNEL_COUNTS))} "
                         "(the Wan 2.1 or the Wan 2.2 VAE's latents)")
    return LATENTS_MEAN, LATENTS_STD


def normalize_latents(raw: torch.Tensor) -> torch.Tensor:
    mean, std = latent_stats(raw.shape[1])
    return (raw.float() - mean) * (1.0 / std)


def denormalize_latents(normalized: torch.Tensor) -> torch.Tensor:
    # Written as diffusers' WanPipeline writes it, so both give bit-identical raw latents.
    mean, std = latent_stats(normalized.shape[1])
    return normalized.float() / (1.0 / std) + mean


def model_space_latents(raw: torch.Tensor) -> torch.Tensor:
    """The start latent a ComfyUI sampler works from: normalised, except an all-zero (empty) latent, which
    ComfyUI's sampler leaves at zero ("don't shift the empty latent image"); decided over the whole batch."""
    return normalize_latents(raw) if bool(raw.any()) else raw.float()


def seeded_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Noise drawn on the CPU from the seed, so every device and every rank starts from the same tensor."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def check_finite(latents: torch.Tensor, step: int, steps: int) -> None:
    """Stop at the step that produced NaN or Inf (which would decode to black frames), naming it."""
    if not torch.isfinite(latents).all():
        raise FloatingPointError(f"the latents hold NaN or Inf after step {step} of {steps}; the model or its "
                                 "weights produce non-finite values in this dtype (try fp32 or bf16, or another file)")
