"""HuMo: the Wan transformer with audio conditioning (ComfyUI's ``HumoWanModel``); runs in the workers.

A HuMo model is the Wan DiT plus two audio parts, named as the released files name them:

* ``audio_proj`` (``AudioProjModel``): each latent frame's window of audio features (whisper features: 8 audio
  frames x 5 layer groups x 1280, as ComfyUI's ``WanHuMoImageToVideo`` makes ``audio_embed`` [B, F, 8, 5, 1280])
  goes through three linear layers (ReLU between) to 16 tokens of width 1536, layer-normed;
* ``blocks.N.audio_cross_attn_wrapper``: after each block's text cross-attention and before its feed-forward,
  ``x + attention(q = norm1_audio(x), k, v = the audio tokens)``, where the queries of one latent frame attend only
  to that frame's 16 audio tokens (ComfyUI's ``WanT2VCrossAttentionGather``; q/k RMS-normed across heads).

Here the audio parts are submodules of diffusers' ``WanTransformer3DModel``: the audio tokens are computed once per
forward (``audio_embed`` is an extra forward argument) and two hooks per block add the audio attention where
native adds it: a forward hook on ``norm2`` (the norm before the text cross-attention; an identity when the model
has none) keeps the block's hidden states, and one on ``attn2`` returns the text attention's output plus the audio
attention of ``hidden states + that output`` (so the block's own residual sum is native's two sums).

The frame grouping is by token position: the block's tokens are the latent's frames in order (``tokens_per_frame``
each), and a run of tokens attends frame by frame (``frame_runs``). On one device the run is the whole sequence;
under ring / Ulysses (the model's ``context_parallel`` plan, applied from outside) it is the rank's slice, which
may start and end in the middle of a frame, and the slice's padding after the last token gets nothing added.
Under tensor parallelism the blocks' hidden states are whole on every rank, so the audio attention runs
replicated (not sharded yet). A reference latent (HuMo's, appended after the video's frames) is the caller's time
concatenation, its audio windows zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

AUDIO_WINDOW = 8  # audio frames per latent frame
AUDIO_LAYER_GROUPS = 5  # whisper layer groups
AUDIO_FEATURES = 1280  # whisper's width
AUDIO_TOKENS = 16  # audio tokens per latent frame
AUDIO_WIDTH = 1536  # the audio tokens' width
AUDIO_HIDDEN = 512  # the projection's inner width


class AdapterLayer(nn.Module):
    """A layer under the released ``.layer`` name (``audio_proj.audio_proj_glob_1.layer.weight``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class AudioProjection(nn.Module):
    """``audio_embed`` [B, F, 8, 5, 1280] -> audio tokens [B, F, 16, 1536] (ComfyUI's ``AudioProjModel``)."""

    def __init__(self):
        super().__init__()
        inputs = AUDIO_WINDOW * AUDIO_LAYER_GROUPS * AUDIO_FEATURES
        self.audio_proj_glob_1 = AdapterLayer(nn.Linear(inputs, AUDIO_HIDDEN))
        self.audio_proj_glob_2 = AdapterLayer(nn.Linear(AUDIO_HIDDEN, AUDIO_HIDDEN))
        self.audio_proj_glob_3 = AdapterLayer(nn.Linear(AUDIO_HIDDEN, AUDIO_TOKENS * AUDIO_WIDTH))
        self.audio_proj_glob_norm = AdapterLayer(nn.LayerNorm(AUDIO_WIDTH))

    def forward(self, audio_embed: torch.Tensor) -> torch.Tensor:
        batch, frames = audio_embed.shape[:2]
        flat = audio_embed.reshape(batch * frames, -1)
        hidden = torch.relu(self.audio_proj_glob_2(torch.relu(self.audio_proj_glob_1(flat))))
        tokens = self.audio_proj_glob_3(hidden).reshape(batch * frames, AUDIO_TOKENS, AUDIO_WIDTH)
        return self.audio_proj_glob_norm(tokens).reshape(batch, frames, AUDIO_TOKENS, AUDIO_WIDTH)


def frame_runs(offset: int, count: int, tokens_per_frame: int) -> list[tuple[int, int, int]]:
    """(frame, first, end) of each run of tokens ``offset .. offset + count`` that lies in one frame, with
    ``first`` and ``end`` relative to ``offset``."""
    runs, position = [], offset
    while position < offset + count:
        frame = position // tokens_per_frame
        end = min((frame + 1) * tokens_per_frame, offset + count)
        runs.append((frame, position - offset, end - offset))
        position = end
    return runs


class AudioCrossAttention(nn.Module):
    """Queries of each latent frame attend to that frame's audio tokens (ComfyUI's ``WanT2VCrossAttentionGather``:
    q from the video width, k and v from the audio width, q and k RMS-normed across heads)."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k, self.v = nn.Linear(AUDIO_WIDTH, dim), nn.Linear(AUDIO_WIDTH, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, audio: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """``x`` [B, L, dim] (the run of tokens ``runs`` describe), ``audio`` [B, F, 16, 1536]."""
        batch, heads = x.shape[0], self.heads
        query = self.norm_q(self.q(x)).unflatten(2, (heads, -1)).transpose(1, 2)
        key = self.norm_k(self.k(audio)).unflatten(3, (heads, -1)).transpose(2, 3)  # [B, F, heads, 16, d]
        value = self.v(audio).unflatten(3, (heads, -1)).transpose(2, 3)
        parts = [F.scaled_dot_product_attention(query[:, :, first:end], key[:, frame], value[:, frame])
                 for frame, first, end in runs]
        return self.o(torch.cat(parts, dim=2).transpose(1, 2).reshape(batch, x.shape[1], -1))


class AudioCrossAttentionWrapper(nn.Module):
    """The released ``audio_cross_attn_wrapper``: its layer norm and the audio cross-attention."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.audio_cross_attn = AudioCrossAttention(dim, heads, eps)
        self.norm1_audio = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, audio: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """What native adds to ``x``: the audio attention of its normed tokens."""
        return self.audio_cross_attn(self.norm1_audio(x), audio, runs)


class WanHumoTransformer3DModel(WanTransformer3DModel):
    """diffusers' Wan transformer with HuMo's audio projection and per-block audio cross-attention.
    ``audio_embed`` [B or 1, F, 8, 5, 1280] is an extra forward argument (none: the plain transformer, as native
    skips the audio attention without it); F must be the latent's frame count."""

    @register_to_config
    def __init__(self, patch_size: tuple[int, ...] = (1, 2, 2), num_attention_heads: int = 40,
                 attention_head_dim: int = 128, in_channels: int = 16, out_channels: int = 16, text_dim: int = 4096,
                 freq_dim: int = 256, ffn_dim: int = 13824, num_layers: int = 40, cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6, image_dim: int | None = None,
                 added_kv_proj_dim: int | None = None, rope_max_seq_len: int = 1024,
                 pos_embed_seq_len: int | None = None):
        super().__init__(patch_size=patch_size, num_attention_heads=num_attention_heads,
                         attention_head_dim=attention_head_dim, in_channels=in_channels, out_channels=out_channels,
                         text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim, num_layers=num_layers,
                         cross_attn_norm=cross_attn_norm, qk_norm=qk_norm, eps=eps, image_dim=image_dim,
                         added_kv_proj_dim=added_kv_proj_dim, rope_max_seq_len=rope_max_seq_len,
                         pos_embed_seq_len=pos_embed_seq_len)
        dim = num_attention_heads * attention_head_dim
        self.audio_proj = AudioProjection()
        self._audio: torch.Tensor | None = None
        self._tokens_per_frame = 0
        for block in self.blocks:
            block.audio_cross_attn_wrapper = AudioCrossAttentionWrapper(dim, num_attention_heads, eps)
            block.norm2.register_forward_hook(self._keep_block_input(block))
            block.attn2.register_forward_hook(self._add_audio_attention(block))

    @staticmethod
    def _keep_block_input(block: nn.Module):
        def hook(module, inputs, output):
            block._audio_input = inputs[0]
        return hook

    def _add_audio_attention(self, block: nn.Module):
        def hook(module, inputs, output):
            if self._audio is None:
                return output
            summed = block._audio_input.type_as(output) + output
            start, valid = self._token_run(summed.shape[1])
            runs = frame_runs(start, valid, self._tokens_per_frame)
            added = block.audio_cross_attn_wrapper(summed[:, :valid], self._audio.to(summed.dtype), runs)
            if valid < summed.shape[1]:  # a sequence slice's padding
                added = torch.cat([added, added.new_zeros(added.shape[0], summed.shape[1] - valid, added.shape[2])], 1)
            return output + added
        return hook

    def _token_run(self, local: int) -> tuple[int, int]:
        """(first token, real tokens) of the blocks' sequence on this rank: the whole one, or the sequence
        slice the context-parallel plan gives it."""
        context = getattr(self, "context_parallel", None)
        if context is None or context.shard is None:
            return 0, local
        start, stop = context.current_shard().bounds()
        return start, stop - start

    def forward(self, hidden_states: torch.Tensor, *args, audio_embed: torch.Tensor | None = None, **kwargs):
        """The transformer's forward with HuMo's audio tokens for this call."""
        if audio_embed is None:
            return super().forward(hidden_states, *args, **kwargs)
        _, _, frames, height, width = hidden_states.shape
        if audio_embed.shape[1] != frames:
            raise ValueError(f"audio_embed has {audio_embed.shape[1]} latent frames of audio; the latent has {frames} "
                             "(WanHuMoImageToVideo makes one window per latent frame)")
        _, p_h, p_w = self.config.patch_size
        tokens_per_frame = (height // p_h) * (width // p_w)
        audio = self.audio_proj(audio_embed.to(self.audio_proj.audio_proj_glob_1.layer.weight.dtype))
        self._audio = audio.expand(hidden_states.shape[0], *audio.shape[1:])
        self._tokens_per_frame = tokens_per_frame
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self._audio = None
