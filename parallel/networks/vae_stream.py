"""Streaming Wan VAE decode: latent chunks decoded one after another; runs in a worker (rank 0 of a stream).

The Wan VAE is causal in time: diffusers' ``AutoencoderKLWan._decode`` feeds the decoder one latent frame at a
time and carries a per-convolution feature cache (``feat_cache`` / ``feat_idx``) from frame to frame, the first
frame flagged ``first_chunk``. ``StreamingVaeDecoder`` runs that same per-frame loop but keeps the cache between
calls, so decoding latent chunks as they finish gives, joined, exactly the frames of one whole decode: the first
latent frame becomes 1 image frame, every later one 4.

The loop is written here rather than calling ``vae.decode`` because diffusers clears the cache at the start and
end of every ``decode`` call; the decoder blocks themselves are diffusers' own.
"""

from __future__ import annotations

import torch

from .frames import pixels_to_frames

__all__ = ["StreamingVaeDecoder", "stream_decoded_frame_count"]


def stream_decoded_frame_count(start_frame: int, latent_frames: int) -> int:
    """Image frames the VAE makes for ``latent_frames`` latent frames starting at latent frame ``start_frame``."""
    if latent_frames <= 0:
        return 0
    return 4 * latent_frames - 3 if start_frame == 0 else 4 * latent_frames


def _decoder_conv_count(vae) -> int:
    """How many causal convolutions of the decoder keep a cache slot (diffusers caches the count on the VAE)."""
    cached = getattr(vae, "_cached_conv_counts", None)
    if cached and "decoder" in cached:
        return cached["decoder"]
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(module, WanCausalConv3d) for module in vae.decoder.modules())


class StreamingVaeDecoder:
    """Decodes consecutive latent chunks of one video with the VAE's causal feature cache kept between chunks.

    ``decode_pixels(chunk)`` takes raw latents [B, 16, n, h, w] and returns the decoder's raw pixels [B, 3, F, H, W]
    (about -1..1, not clamped: clamping happens once, when pixels become frames); ``decode_frames`` returns frames
    [B*F, H, W, 3] in 0..1. Start a new decoder (or ``reset``) per video.
    """

    def __init__(self, vae, device: str | torch.device | None = None):
        self.vae = vae
        self.device = torch.device(device) if device is not None else next(vae.parameters()).device
        self.dtype = next(vae.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        """Forget the frames decoded so far: the next chunk is the start of a video."""
        self._feat_cache: list = [None] * _decoder_conv_count(self.vae)
        self.frames_seen = 0

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        z_dim = self.vae.config.z_dim
        if latents.ndim != 5 or latents.shape[1] != z_dim or latents.shape[2] == 0:
            raise ValueError(f"expected a latent chunk [B, {z_dim}, n>=1, h, w], got shape {list(latents.shape)}")
        x = self.vae.post_quant_conv(latents.to(self.device, self.dtype))
        pieces = []
        for index in range(x.shape[2]):  # one latent frame per decoder call, as diffusers' own decode loop does
            first = self.frames_seen == 0
            pieces.append(self.vae.decoder(x[:, :, index: index + 1], feat_cache=self._feat_cache, feat_idx=[0],
                                           first_chunk=first))
            self.frames_seen += 1
        out = torch.cat(pieces, dim=2)
        if self.vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out

    def decode_frames(self, latents: torch.Tensor) -> torch.Tensor:
        return pixels_to_frames(self.decode_pixels(latents))
