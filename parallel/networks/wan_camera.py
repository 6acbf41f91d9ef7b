"""Wan 2.1 Fun Camera: the Wan transformer with a camera control adapter; runs in the workers.

A Fun Camera model is the Wan DiT plus ``control_adapter``: the camera embedding (``WanCameraEmbedding``'s Plücker
rays, [B, 24, T, H, W] at pixel resolution, four frames' six channels folded per latent frame) is pixel-unshuffled
by 8, patch-embedded by a strided convolution and refined by a residual convolution block, then added to the
patch-embedded latent tokens, as native ComfyUI's ``CameraWanModel`` does. Here the adapter is a submodule of
diffusers' ``WanTransformer3DModel`` and a forward hook on its patch embedding adds the adapter's output, so the
addition happens before anything else sees the tokens: before the sequence split of ring / Ulysses (a hook before
block 0) and, under tensor parallelism, replicated on every rank as the patch embedding itself is (no plan shards
either). Without camera conditions the model is the plain transformer, as native skips the adapter then.
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

CAMERA_PIXEL_SHUFFLE = 8  # the adapter folds 8x8 pixels into channels: the camera embedding is at pixel resolution
CAMERA_CHANNELS = 24  # WanCameraEmbedding: six Plücker channels for each of the four frames of a latent frame


class CameraResidualBlock(nn.Module):
    """Two 3x3 convolutions with a ReLU between them and a skip connection."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x))) + x


class WanCameraAdapter(nn.Module):
    """Camera embedding [B, C, T, H, W] -> tokens on the patch grid [B, dim, T, H/(8p), W/(8p)]; each latent frame
    on its own (2-D convolutions over the frames folded into the batch)."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int], residual_blocks: int = 1):
        super().__init__()
        self.in_channels = in_channels
        self.pixel_unshuffle = nn.PixelUnshuffle(CAMERA_PIXEL_SHUFFLE)
        self.conv = nn.Conv2d(in_channels * CAMERA_PIXEL_SHUFFLE ** 2, dim, kernel_size=patch, stride=patch)
        self.residual_blocks = nn.Sequential(*(CameraResidualBlock(dim) for _ in range(residual_blocks)))

    def forward(self, camera: torch.Tensor) -> torch.Tensor:
        batch, channels, frames, height, width = camera.shape
        if channels != self.in_channels:
            raise ValueError(f"camera_conditions has {channels} channels; this Fun Camera model takes "
                             f"{self.in_channels} (WanCameraEmbedding's)")
        folded = camera.transpose(1, 2).reshape(batch * frames, channels, height, width)
        out = self.residual_blocks(self.conv(self.pixel_unshuffle(folded)))
        return out.reshape(batch, frames, *out.shape[1:]).transpose(1, 2)


class WanCameraTransformer3DModel(WanTransformer3DModel):
    """diffusers' Wan transformer with the Fun Camera control adapter (``camera_in_channels``: the camera
    embedding's channels). ``camera_conditions`` [1 or B, C, T, 8h, 8w] (one row for all, or one per latent row)
    is an extra forward argument; the latent's patch grid must be the adapter's output grid (native adds the two
    and fails otherwise)."""

    @register_to_config
    def __init__(self, patch_size: tuple[int, ...] = (1, 2, 2), num_attention_heads: int = 40,
                 attention_head_dim: int = 128, in_channels: int = 16, out_channels: int = 16, text_dim: int = 4096,
                 freq_dim: int = 256, ffn_dim: int = 13824, num_layers: int = 40, cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6, image_dim: int | None = None,
                 added_kv_proj_dim: int | None = None, rope_max_seq_len: int = 1024,
                 pos_embed_seq_len: int | None = None, camera_in_channels: int = CAMERA_CHANNELS):
        super().__init__(patch_size=patch_size, num_attention_heads=num_attention_heads,
                         attention_head_dim=attention_head_dim, in_channels=in_channels, out_channels=out_channels,
                         text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim, num_layers=num_layers,
                         cross_attn_norm=cross_attn_norm, qk_norm=qk_norm, eps=eps, image_dim=image_dim,
                         added_kv_proj_dim=added_kv_proj_dim, rope_max_seq_len=rope_max_seq_len,
                         pos_embed_seq_len=pos_embed_seq_len)
        self.control_adapter = WanCameraAdapter(camera_in_channels, num_attention_heads * attention_head_dim,
                                                tuple(patch_size[1:]))
        self._camera: torch.Tensor | None = None
        self.patch_embedding.register_forward_hook(self._add_camera_tokens)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                return_dict=True, attention_kwargs=None, camera_conditions=None):
        self._camera = camera_conditions
        try:
            return super().forward(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                   return_dict, attention_kwargs)
        finally:
            self._camera = None

    def _add_camera_tokens(self, module, args, tokens: torch.Tensor) -> torch.Tensor:
        """The patch embedding's output plus the adapter's (rows broadcast from one), in the tokens' dtype."""
        if self._camera is None:
            return tokens
        camera = self.control_adapter(self._camera.to(device=tokens.device, dtype=self.control_adapter.conv.weight.dtype))
        if camera.shape[2:] != tokens.shape[2:] or camera.shape[0] not in (1, tokens.shape[0]):
            raise ValueError(f"camera_conditions of {self._camera.shape[2]} frames at {self._camera.shape[-1]}x"
                             f"{self._camera.shape[-2]} give a {list(camera.shape[2:])} token grid but the latent's is "
                             f"{list(tokens.shape[2:])}; make the camera embedding with the video's width, height "
                             "and length (WanCameraEmbedding)")
        return tokens + camera.to(tokens.dtype)
