"""VAE decode and encode nodes."""

from __future__ import annotations

from .convert import frames_to_image, image_to_frames, latent_to_tensor, tensor_to_latent

CATEGORY = "WanMesh"


class WanMeshVAEDecode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("WANMESH_VAE",), "samples": ("LATENT",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, vae, samples):
        return (frames_to_image(vae.runner.decode(vae.handle, latent_to_tensor(samples))),)


class WanMeshVAEEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("WANMESH_VAE",), "pixels": ("IMAGE",)}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, vae, pixels):
        return (tensor_to_latent(vae.runner.encode(vae.handle, image_to_frames(pixels))),)
