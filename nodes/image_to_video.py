"""The WanMesh Image To Video node: image-to-video conditioning exactly as ComfyUI's native ``WanImageToVideo``
(start image) and ``WanFirstLastFrameToVideo`` (with an end image) make it, the video VAE-encoded on the pool;
runs in the ComfyUI process (the frames are built here, ``parallel/image_to_video.py``; the encode runs on the pool).
"""

from __future__ import annotations

import copy

import torch

from ..parallel.fields import node_input
from ..parallel.image_to_video import first_last_video, start_image_video
from .bridge.convert import clip_vision_tokens, image_to_frames, tensor_to_latent

CATEGORY = "WanMesh/image to video"


def with_values(conditioning, values: dict) -> list:
    """A copy of CONDITIONING with ``values`` set in every entry's options (ComfyUI's conditioning_set_values)."""
    return [[tensor, {**options, **values}] for tensor, options in conditioning]


class WanMeshImageToVideo:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "positive": ("CONDITIONING", {"tooltip": "prompt conditioning; the image conditioning is set on it"}),
                "negative": ("CONDITIONING", {"tooltip": "negative conditioning; gets the same image conditioning"}),
                "vae": ("WANMESH_VAE", {"tooltip": "the Wan VAE that encodes the conditioning video on the pool"}),
                "width": node_input("width"),
                "height": node_input("height"),
                "length": node_input("length"),
                "batch_size": node_input("batch_size"),
            },
            "optional": {
                "clip_vision_output": ("CLIP_VISION_OUTPUT", {
                    "tooltip": "CLIP vision of the start image (Wan 2.1 I2V / FLF2V; without it they run as native does without it, Wan 2.2 I2V takes none)"}),
                "start_image": ("IMAGE", {"tooltip": "first frame(s); resized and center-cropped as native"}),
                "end_image": ("IMAGE", {"tooltip": "last frame(s) (first-last-frame models): WanFirstLastFrameToVideo"}),
                "clip_vision_end_output": ("CLIP_VISION_OUTPUT", {"tooltip": "CLIP vision of the end image (FLF2V)"}),
            },
        }

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "negative", "latent")
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Image-to-video conditioning exactly as ComfyUI's WanImageToVideo makes it, or "
                   "WanFirstLastFrameToVideo when an end image or its CLIP vision is given (the nodes are "
                   "interchangeable), the video VAE-encoded on the worker pool.")

    def encode(self, positive, negative, vae, width, height, length, batch_size, clip_vision_output=None,
               start_image=None, end_image=None, clip_vision_end_output=None):
        latent = torch.zeros(batch_size, 16, (length - 1) // 4 + 1, height // 8, width // 8)
        first_last = end_image is not None or clip_vision_end_output is not None
        start = None if start_image is None else image_to_frames(start_image)
        if first_last:
            end = None if end_image is None else image_to_frames(end_image)
            video, mask = first_last_video(start, end, width, height, length)
        else:
            video, mask = start_image_video(start, width, height, length)
        values = {}
        if video is not None:
            values = {"concat_latent_image": vae.runner.encode(vae.handle, video), "concat_mask": mask}
        clip = clip_vision_output
        if first_last and clip_vision_end_output is not None:
            clip = clip_vision_end_output if clip is None else _joined(clip, clip_vision_end_output)
        if clip is not None:
            values["clip_vision_output"] = clip
        return with_values(positive, values), with_values(negative, values), tensor_to_latent(latent)


def _joined(start, end):
    """A CLIP vision output (ComfyUI's or WanMesh's) whose tokens are the start image's, then the end image's, as
    native FLF2V joins them; Wan reads only these tokens."""
    joined = copy.copy(start)
    joined["penultimate_hidden_states"] = torch.cat([clip_vision_tokens(start), clip_vision_tokens(end)], dim=-2)
    return joined
