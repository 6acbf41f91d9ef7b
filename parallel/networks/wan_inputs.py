"""How the loaded Wan transformer takes its inputs as native Wan takes them; runs in the workers.

Forward hooks on diffusers' ``WanTransformer3DModel`` (and the VACE model): every floating input is cast to the
model's compute dtype at its edge (``compute_dtype``: bf16 / fp16 weights take bf16 / fp16 inputs, as ComfyUI's
``apply_model`` casts them; timesteps stay float32 for the fp32 time embedding); latents of any size are padded to
the patch grid and the output cropped back; image-to-video models get native text lengths and first-last-frame image
tokens, and without CLIP vision tokens attend to the text in their image cross-attention as native Wan does; a
model with a ``ref_conv`` (Wan 2.2 Fun) takes a reference latent (``reference.py``). Applied by the loaders after
the weights are in.
"""

from __future__ import annotations

import torch

from ..config import TEXT_TOKENS
from .reference import drop_reference, install_reference_hooks


def with_native_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """The loaded transformer taking its inputs as native Wan takes them: latents of any size (padded to patches)
    and, for models with image tokens, native text lengths and first-last-frame tokens. In place; returns it."""
    pad_inputs_to_patches(model)
    if hasattr(model, "ref_conv"):
        install_reference_hooks(model)
    else:
        drop_reference(model)
    if getattr(model.config, "image_dim", None):
        pad_text_for_image_tokens(model)
        text_as_missing_image_tokens(model)
        if getattr(model.config, "pos_embed_seq_len", None):
            embed_image_tokens_natively(model.condition_embedder.image_embedder)
    return model


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a loaded transformer computes in: its patch embedding's (the layer every input meets first; the
    modules diffusers keeps in float32, the time embedding and the norms, and weights kept quantized say nothing of
    it), else its first floating parameter's (models without a patch embedding: test doubles)."""
    patch_embedding = getattr(model, "patch_embedding", None)
    if patch_embedding is not None:
        return patch_embedding.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


UNCAST_INPUTS = ("timestep",)  # the time embedding runs in float32 (diffusers keeps it so); it casts for itself


def cast_floating(value, dtype: torch.dtype):
    """``value`` with its floating tensors (also inside lists, tuples and dicts) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def cast_inputs_to_compute_dtype(model: torch.nn.Module) -> None:
    """Every floating input of a forward (latents, text and image tokens, VACE contexts and scales, image, reference,
    pose, face and camera inputs) cast to the model's ``compute_dtype``, the one place where inputs meet the model's
    dtype; the hook runs before every other pre-hook. Timesteps are left as given."""

    def cast(module, args, kwargs):
        dtype = compute_dtype(module)
        kwargs = {name: value if name in UNCAST_INPUTS else cast_floating(value, dtype)
                  for name, value in kwargs.items()}
        return cast_floating(args, dtype), kwargs

    model.register_forward_pre_hook(cast, with_kwargs=True, prepend=True)


def pad_text_for_image_tokens(model: torch.nn.Module) -> None:
    """diffusers' attention tells image tokens from text tokens by assuming exactly TEXT_TOKENS (512) text tokens
    after them; native Wan's text encoder pads every prompt to 512 with zero embeddings, so a shorter context is
    padded the same way here, and a longer one (which native splits by the image token count) is refused."""

    def pad_text(module, args, kwargs):
        text = kwargs.get("encoder_hidden_states")
        if text is None or text.shape[1] == TEXT_TOKENS:
            return args, kwargs
        if text.shape[1] > TEXT_TOKENS:
            raise ValueError(f"image-to-video models take at most {TEXT_TOKENS} text tokens; this prompt has "
                             f"{text.shape[1]}: shorten it")
        kwargs["encoder_hidden_states"] = torch.nn.functional.pad(text, (0, 0, 0, TEXT_TOKENS - text.shape[1]))
        return args, kwargs

    model.register_forward_pre_hook(pad_text, with_kwargs=True)


def text_as_missing_image_tokens(model: torch.nn.Module) -> None:
    """An image-to-video model called without CLIP vision tokens, as native Wan runs it: ComfyUI's
    ``WanI2VCrossAttention`` then has no image token count and slices the whole (embedded) text context as its
    image context, so the image keys and values are made from the text. diffusers' attention would find no image
    tokens at all; the embedded text is handed over as the image tokens instead, which it splits off the same way."""

    def hook(module, args, output):
        temb, timestep_proj, text, image = output
        return output if image is not None else (temb, timestep_proj, text, text)

    model.condition_embedder.register_forward_hook(hook)


def embed_image_tokens_natively(embedder: torch.nn.Module) -> None:
    """FLF2V's image embedding as native Wan computes it: the learned position embedding added to however many
    tokens are given (two images, or one when there is no end image). diffusers' version folds the batch into
    pairs of images and cannot take one image's tokens."""

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        positions = embedder.pos_embed.shape[1]
        tokens = tokens[:, :positions] + embedder.pos_embed[:, : tokens.shape[1]].to(tokens.dtype)
        return embedder.norm2(embedder.ff(embedder.norm1(tokens)))

    embedder.forward = forward


PATCH_PADDING_MODE = "circular"  # as native ComfyUI's WanModel pads the latent before its patch embedding


PADDED_INPUTS = ("hidden_states", "control_hidden_states")  # the video latent and the VACE contexts


def pad_to_patches(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``x[..., T, h, w]`` padded at the end of each of its last three axes to a multiple of ``patch``, wrapping
    around (circular). Leading axes beyond batch and channel (several VACE contexts) are folded for the pad."""
    pad: list[int] = []
    for size, step in zip(reversed(x.shape[-3:]), reversed(patch)):
        pad += [0, -size % step]
    if not any(pad):
        return x
    folded = x.reshape(-1, *x.shape[-4:])
    padded = torch.nn.functional.pad(folded, pad, mode=PATCH_PADDING_MODE)
    return padded.reshape(*x.shape[:-3], *padded.shape[-3:])


def pad_inputs_to_patches(model: torch.nn.Module) -> torch.nn.Module:
    """Let ``model`` take latents of any size, as native Wan does: each forward pads the video latent (and the VACE
    contexts) to the patch grid and crops the output back to the latent's size. In place; returns the model."""
    patch = tuple(model.config.patch_size)
    sizes: list[tuple[int, ...]] = []

    def pad_inputs(module, args, kwargs):
        latent = args[0] if args else kwargs["hidden_states"]  # diffusers' forward takes the latent first
        sizes.append(tuple(latent.shape[-3:]))
        if args:
            args = (pad_to_patches(args[0], patch), *args[1:])
        for name in PADDED_INPUTS:
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = pad_to_patches(kwargs[name], patch)
        return args, kwargs

    def crop_output(module, args, kwargs, output):
        t, h, w = sizes.pop()
        if isinstance(output, tuple):
            return (output[0][..., :t, :h, :w], *output[1:])
        output.sample = output.sample[..., :t, :h, :w]
        return output

    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    model.register_forward_hook(crop_output, with_kwargs=True)
    return model

