"""Live previews while sampling: the current denoised estimate of one latent frame mapped to RGB by a fixed
linear projection of the 16 Wan 2.1 latent channels (no VAE); runs in rank 0's worker, once per step.

The projection numbers are the Wan 2.1 latent-to-RGB factors ComfyUI uses for its own latent previews, applied
to the normalised latent the denoising loop works in. A preview is a small uint8 array at latent resolution
(H/8 x W/8), cheap to make and to send; the UI scales it up.
"""

from __future__ import annotations

import numpy as np
import torch

WAN21_LATENT_RGB = torch.tensor([
    [-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747], [0.0372, 0.2344, 0.1420],
    [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665], [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975],
    [-0.0412, 0.0267, -0.1364], [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
    [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950], [0.1984, 0.0913, 0.1861],
])
WAN21_LATENT_RGB_BIAS = torch.tensor([-0.1835, -0.0868, -0.3360])


def denoised_estimate(latents: torch.Tensor, prediction: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The clean latent the flow prediction points at: x0 = x_t - sigma * v, with sigma = t / 1000."""
    return latents.float() - (float(t) / 1000.0) * prediction.float()


def preview_image(normalized: torch.Tensor) -> np.ndarray:
    """Normalised latents [B, 16, T, h, w] -> RGB uint8 [h, w, 3] of the first video's middle latent frame."""
    frame = normalized[0, :, normalized.shape[2] // 2].float().cpu()
    rgb = torch.einsum("chw,cr->hwr", frame, WAN21_LATENT_RGB) + WAN21_LATENT_RGB_BIAS
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8).numpy()
