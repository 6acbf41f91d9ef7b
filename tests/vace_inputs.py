"""Random native VACE conditioning for the tests: two contexts with different strengths, in ComfyUI's raw format."""

from __future__ import annotations

import torch


def two_vace_contexts(latent_shape, generator: torch.Generator) -> dict:
    """SampleRequest fields for two VACE contexts covering a latent of ``latent_shape``."""
    positions = tuple(latent_shape[2:])
    frames = [torch.randn(1, 32, *positions, generator=generator) for _ in range(2)]
    masks = [torch.rand(1, 64, *positions, generator=generator).round() for _ in range(2)]
    return {"vace_frames": frames, "vace_masks": masks, "vace_strengths": [1.0, 0.6]}
