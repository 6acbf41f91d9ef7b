"""Text encoding, empty latent and sampler nodes."""

from __future__ import annotations

import torch

from ..parallel import SAMPLERS, Cancelled, SampleRequest, latent_shape
from .convert import (
    check_same_vace,
    embeddings_to_conditioning,
    latent_to_tensor,
    read_conditioning,
    tensor_to_latent,
)
from .runtime import interrupted, previews_enabled, progress_reporter, raise_if_interrupted

CATEGORY = "WanMesh/sampling"
MAX_SEED = 0xFFFFFFFFFFFFFFFF


class WanMeshTextEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_encoder": ("WANMESH_TEXT_ENCODER", {"tooltip": "the loaded umT5 text encoder"}),
                             "text": ("STRING", {"multiline": True, "tooltip": "the prompt"})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Encodes a prompt on the pool into ComfyUI's CONDITIONING (padded to Wan's 512 text tokens)."

    def encode(self, text_encoder, text):
        embeddings = text_encoder.runner.encode_text(text_encoder.handle, [text])
        return (embeddings_to_conditioning(embeddings),)


class WanMeshEmptyLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16, "tooltip": "video width (multiple of 16)"}),
                "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16, "tooltip": "video height (multiple of 16)"}),
                "length": ("INT", {"default": 81, "min": 1, "max": 1025, "step": 4, "tooltip": "frames, 4k+1"}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "videos per run"}),
            }
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "generate"
    CATEGORY = CATEGORY
    DESCRIPTION = "An empty Wan video latent [batch, 16, (length-1)/4+1, height/8, width/8]."

    def generate(self, width, height, length, batch_size):
        return (tensor_to_latent(torch.zeros(latent_shape(width, height, length, batch_size))),)


class WanMeshSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANMESH_MODEL", {"tooltip": "the loaded Wan T2V or VACE transformer"}),
                "positive": ("CONDITIONING", {"tooltip": "prompt; VACE contexts (from a VACE encode) ride on it"}),
                "negative": ("CONDITIONING", {"tooltip": "negative prompt (with the same VACE contexts)"}),
                "latent_image": ("LATENT", {"tooltip": "empty latent (or the VACE encode's) fixing size and length"}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "tooltip": "noise seed"}),
                "steps": ("INT", {"default": 30, "min": 1, "max": 1000, "tooltip": "denoising steps"}),
                "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1,
                                  "tooltip": "classifier-free guidance scale; 1 runs one pass per step"}),
                "shift": ("FLOAT", {"default": 5.0, "min": 0.01, "max": 100.0, "step": 0.1,
                                    "tooltip": "flow-matching timestep shift (5 for 720p/480p Wan 2.1)"}),
                "sampler_name": (list(SAMPLERS), {"tooltip": "unipc (Wan's default) or euler"}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01,
                                      "tooltip": "1 starts from noise; less keeps part of the input latent"}),
            },
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Samples a Wan video on the worker pool with every parallel mode of the pool; takes VACE "
                   "through the conditioning (WanMesh's or ComfyUI's native VACE encode), one or several contexts.")

    def sample(self, model, positive, negative, latent_image, seed, steps, cfg, shift, sampler_name, denoise):
        conditional = read_conditioning(positive, "positive")
        unconditional = read_conditioning(negative, "negative")
        check_same_vace(conditional, unconditional)
        request = SampleRequest(
            handle=model.handle, latent=latent_to_tensor(latent_image), positive=conditional.embeddings,
            negative=unconditional.embeddings, seed=seed, steps=steps, guidance_scale=cfg, shift=shift,
            sampler=sampler_name, denoise=denoise, vace_frames=conditional.vace_frames,
            vace_masks=conditional.vace_masks, vace_strengths=conditional.vace_strengths, preview=previews_enabled(model.runner),
        )
        try:
            samples = model.runner.sample(request, progress=progress_reporter(steps), should_stop=interrupted)
        except Cancelled:
            raise_if_interrupted()
            raise
        return (tensor_to_latent(samples),)
