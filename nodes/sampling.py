"""Text encoding, empty latent and sampler nodes."""

from __future__ import annotations

import torch

from ..parallel import SAMPLERS, Cancelled, SampleRequest, latent_shape
from .convert import conditioning_to_embeddings, embeddings_to_conditioning, latent_to_tensor, tensor_to_latent
from .runtime import interrupted, progress_reporter, raise_if_interrupted

CATEGORY = "WanMesh"
MAX_SEED = 0xFFFFFFFFFFFFFFFF


class WanMeshTextEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_encoder": ("WANMESH_TEXT_ENCODER",), "text": ("STRING", {"multiline": True})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, text_encoder, text):
        embeddings = text_encoder.runner.encode_text(text_encoder.handle, [text])
        return (embeddings_to_conditioning(embeddings),)


class WanMeshEmptyLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16}),
                "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16}),
                "length": ("INT", {"default": 81, "min": 1, "max": 1025, "step": 4}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
            }
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "generate"
    CATEGORY = CATEGORY

    def generate(self, width, height, length, batch_size):
        return (tensor_to_latent(torch.zeros(latent_shape(width, height, length, batch_size))),)


class WanMeshSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANMESH_MODEL",),
                "positive": ("CONDITIONING",),
                "negative": ("CONDITIONING",),
                "latent_image": ("LATENT",),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED}),
                "steps": ("INT", {"default": 30, "min": 1, "max": 1000}),
                "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1}),
                "shift": ("FLOAT", {"default": 5.0, "min": 0.01, "max": 100.0, "step": 0.1}),
                "sampler_name": (list(SAMPLERS),),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01}),
            },
            "optional": {"vace": ("WANMESH_VACE",)},
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY

    def sample(self, model, positive, negative, latent_image, seed, steps, cfg, shift, sampler_name, denoise, vace=None):
        request = SampleRequest(
            handle=model.handle,
            latent=latent_to_tensor(latent_image),
            positive=conditioning_to_embeddings(positive),
            negative=conditioning_to_embeddings(negative),
            seed=seed, steps=steps, guidance_scale=cfg, shift=shift, sampler=sampler_name, denoise=denoise,
            vace_context=None if vace is None else vace["context"],
            vace_strength=1.0 if vace is None else vace["strength"],
        )
        try:
            samples = model.runner.sample(request, progress=progress_reporter(steps), should_stop=interrupted)
        except Cancelled:
            raise_if_interrupted()
            raise
        return (tensor_to_latent(samples),)
