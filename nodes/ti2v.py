"""The WanMesh Wan22 Image To Video Latent node: Wan 2.2 TI2V 5B's LATENT exactly as native
``Wan22ImageToVideoLatent`` makes it: the start image VAE-encoded on the pool (the Wan 2.2 VAE), its latents in the
first latent frames and a ``noise_mask`` of 0 there, which the WanMesh Sampler and ComfyUI's samplers on the WanMesh
MODEL keep; runs in the ComfyUI process (the arithmetic is ``parallel/image_to_video.py``'s, the encode the pool's).
"""

from __future__ import annotations

from ..parallel.fields import node_input
from ..parallel.image_to_video import wan22_image_latent, wan22_start_frames
from .bridge.convert import image_to_frames

CATEGORY = "WanMesh/image to video"


class WanMeshWan22ImageToVideoLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("WANMESH_VAE", {"tooltip": "the Wan 2.2 VAE (48 latent channels) that encodes the start image "
                                                   "on the pool"}),
                "width": node_input("width"),
                "height": node_input("height"),
                "length": node_input("length"),
                "batch_size": node_input("batch_size"),
            },
            "optional": {
                "start_image": ("IMAGE", {"tooltip": "first frame(s), kept in the video; resized and center-cropped "
                                                     "as native (none: text-to-video)"}),
            },
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Wan 2.2 TI2V 5B's latent exactly as ComfyUI's Wan22ImageToVideoLatent makes it (the nodes are "
                   "interchangeable): empty for text-to-video; with a start image, its latents (encoded on the worker "
                   "pool) in the first frames and a noise mask that keeps them while sampling.")

    def encode(self, vae, width, height, length, batch_size, start_image=None):
        start = None if start_image is None else image_to_frames(start_image)
        frames = wan22_start_frames(start, width, height, length)
        encoded = None if frames is None else vae.runner.encode(vae.handle, frames)
        return (wan22_image_latent(encoded, width, height, length, batch_size),)
