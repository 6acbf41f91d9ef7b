"""The reference image of Wan 2.2 Fun models (their ``ref_conv``) on diffusers' Wan transformer; runs in the workers.

Native Wan (ComfyUI's ``WanModel`` with ``in_dim_ref_conv``) embeds the reference latent [B, C, h, w] with a 2-D
convolution of the patch's spatial size, puts its tokens before the video tokens, gives them the RoPE positions of
one more leading latent frame (the video's frames move one frame on), the same timestep as the row, and drops
their outputs after the head.

Here the reference rides as that leading frame: a pre-hook on the transformer pops the ``reference_latent``
keyword and prepends one zero frame to the model input, a hook on the patch embedding puts the reference's
tokens in that frame's place, and a hook on the output drops the frame. Everything between (RoPE, blocks, the
sequence split of ring / Ulysses, the gather) sees a video one frame longer, so the split covers the reference
tokens exactly with no code of its own. A call without a reference runs unchanged; a model without ``ref_conv``
takes a reference it is given as native does: it ignores it (the keyword is dropped by ``drop_reference``).
"""

from __future__ import annotations

import torch
from torch import nn

REFERENCE_KEYWORD = "reference_latent"


def add_reference_conv(model: nn.Module, in_channels: int) -> nn.Module:
    """Give ``model`` its ``ref_conv`` (``in_channels`` -> the model width, kernel and stride the patch's spatial
    size, as native) on the parameters' device (meta for a model built empty); ``wan_inputs.with_native_inputs``
    installs the hooks that feed a reference through it. In place; returns the model."""
    patch = tuple(model.config.patch_size)
    width = model.config.num_attention_heads * model.config.attention_head_dim
    device = next(model.parameters()).device
    model.ref_conv = nn.Conv2d(in_channels, width, kernel_size=patch[1:], stride=patch[1:], device=device)
    return model


def install_reference_hooks(model: nn.Module) -> None:
    """The hooks that run a ``reference_latent`` keyword through ``model.ref_conv`` as native Wan does (see the
    module docstring). Install after the patch-padding hooks (``wan_inputs.py``): the output hook goes first."""
    references: list[torch.Tensor | None] = []

    def prepend_frame(module, args, kwargs):
        reference = kwargs.pop(REFERENCE_KEYWORD, None)
        references.append(reference)
        if reference is None:
            return args, kwargs
        latent = args[0] if args else kwargs["hidden_states"]
        _check_reference(module, reference, latent, kwargs.get("timestep"))
        padded = torch.cat([latent.new_zeros(latent[:, :, :1].shape), latent], dim=2)
        if args:
            return (padded, *args[1:]), kwargs
        kwargs["hidden_states"] = padded
        return args, kwargs

    def reference_tokens(module, args, output):
        reference = references[-1] if references else None
        if reference is None:
            return output
        tokens = model.ref_conv(reference.to(device=output.device, dtype=model.ref_conv.weight.dtype))
        return torch.cat([tokens.to(output.dtype).unsqueeze(2), output[:, :, 1:]], dim=2)

    def drop_frame(module, args, kwargs, output):
        reference = references.pop()
        if reference is None:
            return output
        if isinstance(output, tuple):
            return (output[0][:, :, 1:], *output[1:])
        output.sample = output.sample[:, :, 1:]
        return output

    model.register_forward_pre_hook(prepend_frame, with_kwargs=True)
    model.patch_embedding.register_forward_hook(reference_tokens)
    model.register_forward_hook(drop_frame, with_kwargs=True, prepend=True)


def drop_reference(model: nn.Module) -> None:
    """A model without ``ref_conv`` called with a reference: the keyword is dropped, as native Wan ignores it."""

    def drop(module, args, kwargs):
        kwargs.pop(REFERENCE_KEYWORD, None)
        return args, kwargs

    model.register_forward_pre_hook(drop, with_kwargs=True)


def _check_reference(model: nn.Module, reference: torch.Tensor, latent: torch.Tensor, timestep) -> None:
    """One line for what native cannot run either: a reference of another size than the (patch-padded) latent,
    another channel count than ``ref_conv`` takes, or per-frame timesteps (a noise mask) beside it."""
    patch = tuple(model.config.patch_size)
    expected = (latent.shape[0], model.ref_conv.in_channels, latent.shape[-2], latent.shape[-1])
    if reference.ndim != 4 or tuple(reference.shape) != expected or any(
            size % step for size, step in zip(reference.shape[-2:], patch[1:])):
        raise ValueError(f"the reference latent has shape {list(reference.shape)}; this model takes one of shape "
                         f"{list(expected)} (the latent's rows, its ref_conv's channels, the latent's height and width, "
                         f"each a multiple of {patch[1]}): encode the reference image at the video's size")
    if timestep is not None and timestep.ndim == 2:
        raise ValueError("a reference latent cannot be combined with per-frame timesteps (a LATENT noise mask, "
                         "e.g. Wan22ImageToVideoLatent); sample the reference image without a noise mask")
