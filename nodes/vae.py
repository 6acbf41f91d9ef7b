"""VAE decode and encode nodes (optionally tiled; tiles are shared by the pool's first vae_patch ranks)."""

from __future__ import annotations

from ..parallel import WorkerError, check_encode_frames
from ..parallel.fields import node_input
from ..parallel.validation import check_latents_for_vae
from .bridge.convert import frames_to_image, image_to_frames, latent_to_tensor, tensor_to_latent
from .bridge.errors import keep_latents, worker_error

CATEGORY = "WanMesh/video"
TILE_OPTIONS = {name: node_input(name) for name in ("tile_px", "overlap_px")}


def _tiles(tile_px: int, overlap_px: int) -> dict:
    return {"tile_px": tile_px or None, "overlap_px": overlap_px if tile_px else None}


class WanMeshVAEDecode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("WANMESH_VAE", {"tooltip": "the loaded Wan VAE"}),
                             "samples": ("LATENT", {"tooltip": "raw Wan latents (WanMesh or native)"})}, "optional": TILE_OPTIONS}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Decodes Wan latents to frames on the pool (tiles shared by the pool's vae_patch ranks)."

    def decode(self, vae, samples, tile_px=0, overlap_px=64):
        latents = latent_to_tensor(samples)
        if vae.path is not None and latents.ndim == 5:  # another model's latents: refused from the VAE's header
            check_latents_for_vae(int(latents.shape[1]), vae.path, "samples", "vae")
        try:
            frames = vae.runner.decode(vae.handle, latents, **_tiles(tile_px, overlap_px))
        except WorkerError as error:  # the sampled latents are not lost with the decode
            raise worker_error(error, "WanMeshVAEDecode", f"; the latents were saved to {keep_latents(latents)}") from None
        return (frames_to_image(frames),)


class WanMeshVAEEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("WANMESH_VAE", {"tooltip": "the loaded Wan VAE"}),
                             "pixels": ("IMAGE", {"tooltip": "frames to encode; as native VAEEncode, sizes are cut to multiples of 8 around the centre and frames past the last 4k+1 are dropped"})}, "optional": TILE_OPTIONS}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Encodes frames to raw Wan latents on the pool (tiles shared by the pool's vae_patch ranks)."

    def encode(self, vae, pixels, tile_px=0, overlap_px=64):
        check_encode_frames(pixels.shape[2], pixels.shape[1], pixels.shape[0])  # native's sizes, before any worker work
        latents = vae.runner.encode(vae.handle, image_to_frames(pixels), **_tiles(tile_px, overlap_px))
        return (tensor_to_latent(latents),)
