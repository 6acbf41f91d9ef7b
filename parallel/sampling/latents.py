"""Wan latent space: the raw <-> normalised conversion and the seeded starting noise; runs in the workers.

Latents enter and leave the pack as raw Wan VAE latents, as ComfyUI's native Wan nodes hold them; the denoising loop and the VACE context
work on latents normalised with the Wan 2.1 latent mean/std, taken from diffusers' AutoencoderKLWan defaults.
"""

from __future__ import annotations

import inspect

import torch
from diffusers import AutoencoderKLWan


def _wan_latent_stats() -> tuple[torch.Tensor, torch.Tensor]:
    """Wan 2.1 latent mean/std, taken from diffusers' AutoencoderKLWan defaults (the released VAE's values)."""
    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    mean = torch.tensor(params["latents_mean"].default, dtype=torch.float32).view(1, -1, 1, 1, 1)
    std = torch.tensor(params["latents_std"].default, dtype=torch.float32).view(1, -1, 1, 1, 1)
    return mean, std


LATENTS_MEAN, LATENTS_STD = _wan_latent_stats()


def normalize_latents(raw: torch.Tensor) -> torch.Tensor:
    return (raw.float() - LATENTS_MEAN) * (1.0 / LATENTS_STD)


def denormalize_latents(normalized: torch.Tensor) -> torch.Tensor:
    # Written as diffusers' WanPipeline writes it, so both give bit-identical raw latents.
    return normalized.float() / (1.0 / LATENTS_STD) + LATENTS_MEAN


def seeded_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Noise drawn on the CPU from the seed, so every device and every rank starts from the same tensor."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def check_finite(latents: torch.Tensor, step: int, steps: int) -> None:
    """Stop at the step that produced NaN or Inf (which would decode to black frames), naming it."""
    if not torch.isfinite(latents).all():
        raise FloatingPointError(f"the latents hold NaN or Inf after step {step} of {steps}; the model or its "
                                 "weights produce non-finite values in this dtype (try fp32 or bf16, or another file)")
