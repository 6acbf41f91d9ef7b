"""VACE encode (interchangeable with ComfyUI's native WanVaceToVideo) and trim-latent nodes."""

from __future__ import annotations

import torch

from ..parallel import EncodeVace
from ..parallel.fields import node_input
from .bridge.convert import latent_to_tensor, tensor_to_latent, with_vace

CATEGORY = "WanMesh/vace"
REFERENCE_CHOICES = ("first", "all")


class WanMeshVaceEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "positive": ("CONDITIONING", {"tooltip": "prompt conditioning; the VACE context is appended to it"}),
                "negative": ("CONDITIONING", {"tooltip": "negative conditioning; gets the same VACE context"}),
                "vae": ("WANMESH_VAE", {"tooltip": "the Wan VAE that encodes the VACE inputs on the pool"}),
                "width": node_input("vace_width"),
                "height": node_input("vace_height"),
                "length": node_input("length"),
                "batch_size": node_input("batch_size"),
                "strength": node_input("vace_strength"),
            },
            "optional": {
                "control_video": ("IMAGE", {"tooltip": "video to follow or edit (grey = generate freely)"}),
                "control_masks": ("MASK", {"tooltip": "1 = generate, 0 = keep the control video"}),
                "reference_image": ("IMAGE", {"tooltip": "reference image(s); see reference_images"}),
                # after every older input, so saved workflows keep their widget order
                "reference_images": (list(REFERENCE_CHOICES), {
                    "default": REFERENCE_CHOICES[0],
                    "tooltip": "first: only the first reference image, as native WanVaceToVideo; all: every frame of "
                               "reference_image is its own reference (one latent frame each), beyond native"}),
            },
        }

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT", "INT")
    RETURN_NAMES = ("positive", "negative", "latent", "trim_latent")
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = ("VACE conditioning exactly as ComfyUI's WanVaceToVideo makes it (the two nodes are "
                   "interchangeable: first reference only, control video and masks cut or padded to length), "
                   "VAE-encoded on the worker pool; several references (reference_images: all) and chained "
                   "encodes (several contexts) are supported.")

    def encode(self, positive, negative, vae, width, height, length, batch_size, strength,
               control_video=None, control_masks=None, reference_image=None, reference_images="first"):
        if reference_images not in REFERENCE_CHOICES:
            raise ValueError(f"reference_images {reference_images!r} is unknown; valid: {', '.join(REFERENCE_CHOICES)}")
        if reference_image is not None and reference_images == "first":
            reference_image = reference_image[:1]
        encoded = vae.runner.encode_vace(EncodeVace(
            handle=vae.handle, width=width, height=height, length=length, control_video=_cpu(control_video),
            control_masks=_cpu(control_masks), reference_images=_cpu(reference_image)))
        _, _, frames, h, w = encoded.frames.shape
        latent = torch.zeros([batch_size, 16, frames, h, w])
        return (with_vace(positive, encoded.frames, encoded.mask, strength),
                with_vace(negative, encoded.frames, encoded.mask, strength),
                tensor_to_latent(latent), encoded.trim_latent)


class WanMeshTrimLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "samples": ("LATENT", {"tooltip": "sampled latent that starts with the reference frames"}),
            "trim_amount": ("INT", {"default": 0, "min": 0, "max": 99999,
                                    "tooltip": "latent frames to drop from the start (the VACE encode's trim_latent)"}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "trim"
    CATEGORY = CATEGORY
    DESCRIPTION = "Drops the reference frames' latents after VACE sampling (like ComfyUI's TrimVideoLatent)."

    def trim(self, samples, trim_amount):
        latents = latent_to_tensor(samples)
        if trim_amount >= latents.shape[2]:
            raise ValueError(f"trim_amount {trim_amount} would drop all {latents.shape[2]} latent frames; "
                             f"valid: 0 to {latents.shape[2] - 1}")
        return (tensor_to_latent(latents[:, :, trim_amount:]),)


def _cpu(tensor):
    return None if tensor is None else tensor.float().cpu()
