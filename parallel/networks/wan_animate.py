"""Wan 2.2 Animate: diffusers' Wan transformer with the pose embedding, the face motion encoder, the face encoder
and the face adapter blocks; runs in the workers.

The transformer blocks, embeddings and head are diffusers' ``WanTransformer3DModel`` (the Wan 2.1 I2V layout:
36 input channels, CLIP vision tokens), so the tensor-parallel and context-parallel plans apply to them unchanged.
The Animate parts hang on it as hooks: the pose latents' patch embedding is added to every frame after the first
(the reference frame) right after the patch embedding, before the sequence is split; after every fifth block a
face adapter block adds a cross attention of each latent frame's tokens over that frame's face tokens.

Why not diffusers' ``WanAnimateTransformer3DModel``: its face attention cuts the sequence into as many equal parts
as there are face frames, which breaks when a rank holds a slice of the sequence that starts mid-frame (ring /
Ulysses); it requires a face video and a pose video of exactly the latent's length (native pads, cuts or leaves
them out); its motion direction is stabilised by adding 1e-8 to every entry where the released model (and
ComfyUI) adds 1e-8 times the identity; and its key converter splits and reshapes tensors, so it cannot serve as the
name map of the per-tensor reader. Here the modules keep the released files' names (``motion_encoder.enc.*``,
``face_adapter.fuser_blocks.N.linear1_kv``, ...) so every tensor loads as stored; diffusers' face encoder is used
as is (its weights differ from the released ones by names only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan_animate import WanAnimateFaceEncoder
from torch import nn

ANIMATE_CLASS_NAME = "WanAnimateTransformer"
FACE_ADAPTER_EVERY = 5  # a face adapter block after blocks 0, 5, 10, ...
FACE_SIZE = 512  # the face video's frames, square: the motion encoder reduces them to one vector each
MOTION_DIM = 20
STYLE_DIM = 512
FACE_ENCODER_HIDDEN = 1024
FACE_ENCODER_HEADS = 4
FACE_CACHE_SIZE = 2  # face videos whose tokens are kept: a guided sampler's conditional and unconditional ones
MOTION_ENCODER_BATCH = 8  # frames through the motion encoder at a time, as native encodes them
LEAKY_SLOPE = 0.2
BLUR_KERNEL = (1.0, 3.0, 3.0, 1.0)
EPS = 1e-6
# released names -> this module's names, where diffusers' face encoder names its convolutions without ``.conv``
FACE_ENCODER_RENAMES = {f"face_encoder.{conv}.conv.": f"face_encoder.{conv}." for conv in ("conv1_local", "conv2", "conv3")}


# -- the motion encoder (the released StyleGAN-like appearance encoder, its layout and numerics) ------------------


class EqualConv2d(nn.Module):
    """A convolution whose weight is scaled by 1/sqrt(fan-in) at run time."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, padding: int = 0,
                 bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.scale, self.stride, self.padding = 1 / math.sqrt(in_channels * kernel * kernel), stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight * self.scale, self.bias, stride=self.stride, padding=self.padding)


class EqualLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.scale = 1 / math.sqrt(in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.scale, self.bias)


class BiasedLeakyReLU(nn.Module):
    """Leaky ReLU after a per-channel bias, scaled by sqrt(2); the bias is stored as [1, C, 1, 1]."""

    def __init__(self, channels: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x + self.bias, LEAKY_SLOPE) * math.sqrt(2)


class Blur(nn.Module):
    """The [1, 3, 3, 1] low-pass filter on every channel, padded by ``pad`` on each side (no stored weights)."""

    def __init__(self, pad: int):
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taps = torch.tensor(BLUR_KERNEL, dtype=x.dtype, device=x.device)
        kernel = taps[None, :] * taps[:, None]
        kernel = (kernel / kernel.sum()).expand(x.shape[1], 1, -1, -1)
        return F.conv2d(F.pad(x, [self.pad] * 4), kernel, groups=x.shape[1])


def conv_layer(in_channels: int, out_channels: int, kernel: int, downsample: bool = False,
               activate: bool = True, bias: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    if downsample:  # blur, then a stride-2 convolution without padding
        layers.append(Blur((len(BLUR_KERNEL) - 2 + kernel - 1 + 1) // 2))
    padding = 0 if downsample else kernel // 2
    layers.append(EqualConv2d(in_channels, out_channels, kernel, 2 if downsample else 1, padding,
                              bias=bias and not activate))
    if activate:
        layers.append(BiasedLeakyReLU(out_channels))
    return nn.Sequential(*layers)


class ResBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = conv_layer(in_channels, in_channels, 3)
        self.conv2 = conv_layer(in_channels, out_channels, 3, downsample=True)
        self.skip = conv_layer(in_channels, out_channels, 1, downsample=True, activate=False, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x)) + self.skip(x)) / math.sqrt(2)


class AppearanceEncoder(nn.Module):
    """512x512 RGB -> a 512-vector: a 1x1 convolution, seven downsampling residual blocks, a 4x4 convolution."""

    CHANNELS = (32, 64, 128, 256, 512, 512, 512, 512)

    def __init__(self):
        super().__init__()
        widths = self.CHANNELS
        blocks = [ResBlock(a, b) for a, b in zip(widths[:-1], widths[1:])]
        self.convs = nn.ModuleList([conv_layer(3, widths[0], 1), *blocks,
                                    EqualConv2d(widths[-1], STYLE_DIM, 4, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = conv(x)
        return x.squeeze(-1).squeeze(-1)


class MotionEncoderParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.net_app = AppearanceEncoder()
        self.fc = nn.Sequential(*[EqualLinear(STYLE_DIM, STYLE_DIM) for _ in range(4)],
                                EqualLinear(STYLE_DIM, MOTION_DIM))


class MotionDirection(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(STYLE_DIM, MOTION_DIM))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        """The motion coefficients [N, 20] along the orthonormalised directions -> [N, 512]."""
        stabilised = self.weight + 1e-8 * torch.eye(*self.weight.shape, device=motion.device, dtype=motion.dtype)
        directions, _ = torch.linalg.qr(stabilised.float())
        return torch.sum(motion.unsqueeze(-1) * directions.T.to(motion.dtype), dim=1)


class MotionDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.direction = MotionDirection()


class MotionEncoder(nn.Module):
    """Face frames [N, 3, 512, 512] in [-1, 1] -> motion vectors [N, 512], ``MOTION_ENCODER_BATCH`` frames at a
    time; each frame's vector depends on that frame only (``distributed/frame_split.py`` splits the frames)."""

    def __init__(self):
        super().__init__()
        self.enc = MotionEncoderParts()
        self.dec = MotionDecoder()

    def forward(self, faces: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.dec.direction(self.enc.fc(self.enc.net_app(part)))
                          for part in faces.split(MOTION_ENCODER_BATCH)])


# -- the face adapter ---------------------------------------------------------------------------------------------


class FaceBlock(nn.Module):
    """Each video token attends to the face tokens of its own latent frame (queries from the video, keys and values
    from the face), per head, with RMS-normalised queries and keys."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.linear1_kv = nn.Linear(dim, 2 * dim)
        self.linear1_q = nn.Linear(dim, dim)
        self.linear2 = nn.Linear(dim, dim)
        self.q_norm = nn.RMSNorm(dim // heads, eps=EPS)
        self.k_norm = nn.RMSNorm(dim // heads, eps=EPS)

    def forward(self, x: torch.Tensor, face: torch.Tensor, token_frames: torch.Tensor) -> torch.Tensor:
        """``x`` [B, s, dim] (this rank's tokens), ``face`` [B, T, N, dim] (every latent frame's face tokens),
        ``token_frames`` [s]: each token's latent frame, -1 for sequence padding (its output is zero)."""
        batch, frames, count, dim = face.shape
        kv = self.linear1_kv(F.layer_norm(face, (dim,), eps=EPS)).view(batch, frames, count, 2, self.heads, -1)
        query = self.q_norm(self.linear1_q(F.layer_norm(x, (dim,), eps=EPS)).unflatten(-1, (self.heads, -1)))
        key, value = self.k_norm(kv[..., 0, :, :]).to(kv.dtype), kv[..., 1, :, :]
        out = x.new_zeros(batch, x.shape[1], self.heads, dim // self.heads)
        for frame, start, stop in frame_runs(token_frames):
            attended = F.scaled_dot_product_attention(query[:, start:stop].transpose(1, 2),
                                                      key[:, frame].transpose(1, 2), value[:, frame].transpose(1, 2))
            out[:, start:stop] = attended.transpose(1, 2)
        return self.linear2(out.flatten(2))


def frame_runs(token_frames: torch.Tensor) -> list[tuple[int, int, int]]:
    """(frame, first token, end token) of each run of consecutive tokens of one latent frame; padding left out."""
    values = token_frames.tolist()
    runs, start = [], 0
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[start]:
            if values[start] >= 0:
                runs.append((values[start], start, index))
            start = index
    return runs


class FaceAdapter(nn.Module):
    def __init__(self, dim: int, heads: int, count: int):
        super().__init__()
        self.fuser_blocks = nn.ModuleList([FaceBlock(dim, heads) for _ in range(count)])


# -- the model ----------------------------------------------------------------------------------------------------


@dataclass
class AnimateCall:
    """One forward's Animate inputs, read by the hooks."""

    pose_latents: torch.Tensor | None
    face: torch.Tensor | None  # [B, T, N, dim]: the face tokens of every latent frame (zeros where there is none)
    tokens_per_frame: int


class WanAnimateTransformer(WanTransformer3DModel):
    """Wan 2.2 Animate: ``WanTransformer3DModel`` (I2V layout) plus ``pose_patch_embedding``, ``motion_encoder``,
    ``face_encoder`` and ``face_adapter`` under their released names. ``forward`` takes ``pose_latents``
    [B, 16, T', h, w] (normalised; added to frames 1..T'), and ``face_pixel_values`` [B, 3, F, 512, 512] in
    [-1, 1]: both optional, as native."""

    @classmethod
    def from_config(cls, config, **kwargs):
        model = super().from_config(config, **kwargs)
        model.add_animate_modules()
        return model

    def add_animate_modules(self) -> None:
        config = self.config
        dim, heads = config.num_attention_heads * config.attention_head_dim, config.num_attention_heads
        self.pose_patch_embedding = nn.Conv3d(config.out_channels, dim, kernel_size=config.patch_size,
                                              stride=config.patch_size)
        self.motion_encoder = MotionEncoder()
        self.face_encoder = WanAnimateFaceEncoder(STYLE_DIM, dim, FACE_ENCODER_HIDDEN, FACE_ENCODER_HEADS)
        self.face_adapter = FaceAdapter(dim, heads, config.num_layers // FACE_ADAPTER_EVERY)
        self.animate_call: AnimateCall | None = None
        self.patch_embedding.register_forward_hook(self._add_pose)
        for index in range(0, config.num_layers, FACE_ADAPTER_EVERY):
            self.blocks[index].register_forward_hook(self._face_adapter_hook(index // FACE_ADAPTER_EVERY))

    def forward(self, hidden_states, timestep, encoder_hidden_states, *args, pose_latents=None,
                face_pixel_values=None, **kwargs):
        frames, height, width = hidden_states.shape[-3:]
        p_t, p_h, p_w = self.config.patch_size
        face = None if face_pixel_values is None else self.cached_face_tokens(face_pixel_values, frames // p_t)
        self.animate_call = AnimateCall(pose_latents, face, (height // p_h) * (width // p_w))
        try:
            return super().forward(hidden_states, timestep, encoder_hidden_states, *args, **kwargs)
        finally:
            self.animate_call = None

    def cached_face_tokens(self, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """``face_tokens``, reused while the same face video comes again (a sampler sends it at every step, and the
        encoders do not depend on the step): the last ``FACE_CACHE_SIZE`` videos are kept with the version of the
        encoders' weights they were made with (a LoRA merge or reload changes it), and compared exactly."""
        version = self._face_weights_version()
        cache = self.__dict__.setdefault("_face_cache", [])
        for entry in cache:
            if entry[1:3] == (frames, version) and entry[0].shape == pixels.shape and torch.equal(entry[0], pixels):
                return entry[3]
        tokens = self.face_tokens(pixels, frames)
        cache.insert(0, (pixels.detach().clone(), frames, version, tokens))
        del cache[FACE_CACHE_SIZE:]
        return tokens

    def _face_weights_version(self) -> tuple:
        """What changes when the encoders' weights change: their tensors' identities and in-place versions."""
        parameters = [*self.motion_encoder.parameters(), *self.face_encoder.parameters()]
        try:
            return tuple((id(parameter), parameter._version) for parameter in parameters)
        except RuntimeError:  # inference tensors keep no version: they cannot change in place
            return tuple(id(parameter) for parameter in parameters)

    def face_tokens(self, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """The face tokens [B, frames, 5, dim] of a face video [B, 3, F, 512, 512]: motion vectors frame by frame,
        the face encoder over time (4x shorter), a zero first frame (the reference frame's), then zeros or a cut to
        the latent's frame count, as native."""
        batch, channels, count = pixels.shape[:3]
        flat = pixels.transpose(1, 2).reshape(batch * count, channels, *pixels.shape[-2:])
        motion = self.motion_encoder(flat)
        face = self.face_encoder(motion.view(batch, count, -1))
        face = torch.cat([face.new_zeros(batch, 1, *face.shape[2:]), face], dim=1)[:, :frames]
        missing = frames - face.shape[1]
        return torch.cat([face, face.new_zeros(batch, missing, *face.shape[2:])], dim=1) if missing > 0 else face

    def _add_pose(self, module, args, output: torch.Tensor) -> torch.Tensor:
        call = self.animate_call
        if call is None or call.pose_latents is None:
            return output
        pose = self.pose_patch_embedding(call.pose_latents.to(output.dtype))
        frames = min(pose.shape[2], output.shape[2] - 1)
        output = output.clone()
        output[:, :, 1:frames + 1] += pose[:, :, :frames]
        return output

    def _face_adapter_hook(self, index: int):
        def hook(module, args, output: torch.Tensor) -> torch.Tensor:
            call = self.animate_call
            if call is None or call.face is None:
                return output
            return output + self.face_adapter.fuser_blocks[index](output, call.face.to(output.dtype),
                                                                  self._token_frames(output.shape[1], call))
        return hook

    def _token_frames(self, local_tokens: int, call: AnimateCall) -> torch.Tensor:
        """Each local token's latent frame: the rank's slice of the sequence under context parallelism
        (``distributed/context_parallel.py``), -1 for its padding."""
        context = getattr(self, "context_parallel", None)
        start, valid = 0, None
        if context is not None:
            shard = context.current_shard()
            start, valid = shard.index * shard.local_len, shard.valid_len
        positions = torch.arange(start, start + local_tokens)
        frames = positions // call.tokens_per_frame
        return frames if valid is None else torch.where(positions < valid, frames, -1)


def released_animate_name(name: str) -> str:
    """The module name of a released Animate tensor (``face_encoder.conv1_local.conv.weight`` ->
    ``face_encoder.conv1_local.weight``); other names unchanged."""
    for released, ours in FACE_ENCODER_RENAMES.items():
        if name.startswith(released):
            return ours + name[len(released):]
    return name


ANIMATE_PREFIXES = ("pose_patch_embedding.", "motion_encoder.", "face_encoder.", "face_adapter.")


def animate_released_name(name: str) -> str:
    """The inverse of ``released_animate_name``: the released file's name of one of this module's tensors."""
    for released, ours in FACE_ENCODER_RENAMES.items():
        if name.startswith(ours):
            return released + name[len(ours):]
    return name
