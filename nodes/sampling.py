"""Text encoding, empty latent and sampler nodes."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..parallel import COMFY_SAMPLERS, SAMPLERS, SCHEDULERS, T2V_EXPERT_BOUNDARY, Cancelled, SampleRequest, latent_shape
from ..parallel.driver.timings import RunTimings
from ..parallel.config import DEFAULT_SCHEDULER
from ..parallel.fields import END_STEP_TO_THE_END, node_input
from ..parallel.cache_settings import describe_report
from ..parallel.validation import prompt_length_warning
from .bridge.conditioning_keys import carries_family_keys, check_conditioning_keys, check_family_keys
from .bridge.convert import (
    animate_passes,
    check_same_vace,
    humo_passes,
    embeddings_to_conditioning,
    latent_noise_mask,
    latent_to_tensor,
    negative_image,
    read_conditioning,
    tensor_to_latent,
)
from .bridge.pool_model import native_class_name
from .bridge.runtime import arrange_for_job, interrupted, previews_enabled, progress_reporter, raise_if_interrupted

CATEGORY = "WanMesh/sampling"
logger = logging.getLogger(__name__)


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
        warning = prompt_length_warning(text, text_encoder.path)
        if warning:
            logger.warning("WanMesh Text Encode: %s", warning)
        embeddings = text_encoder.runner.encode_text(text_encoder.handle, [text])
        return (embeddings_to_conditioning(embeddings),)


class WanMeshEmptyLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "width": node_input("width"),
                "height": node_input("height"),
                "length": node_input("length"),
                "batch_size": node_input("batch_size"),
            }
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "generate"
    CATEGORY = CATEGORY
    DESCRIPTION = "An empty Wan video latent [batch, 16, (length-1)/4+1, height/8, width/8]."

    def generate(self, width, height, length, batch_size):
        return (tensor_to_latent(torch.zeros(latent_shape(width, height, length, batch_size))),)


def _comfy_names(attribute: str) -> list[str]:
    """ComfyUI's own sampler or scheduler names, when ComfyUI is at hand (empty otherwise)."""
    try:
        import comfy.samplers
    except ImportError:
        return []
    return list(getattr(comfy.samplers.KSampler, attribute, []))


def sampler_choices() -> list[str]:
    """The workers' samplers (Wan's UniPC first, the default of saved workflows), then ComfyUI's other samplers."""
    return list(dict.fromkeys([*SAMPLERS, *_comfy_names("SAMPLERS")]))


def scheduler_choices() -> list[str]:
    return list(dict.fromkeys([*SCHEDULERS, *_comfy_names("SCHEDULERS")]))


def runs_in_the_workers(sampler_name: str, scheduler: str) -> bool:
    """Whether the workers run this sampler and scheduler themselves (the whole loop in one request); otherwise
    ComfyUI's own sampler runs here on the pool MODEL (``comfy_sampling.py``)."""
    return sampler_name in SAMPLERS and (sampler_name not in COMFY_SAMPLERS or scheduler in SCHEDULERS)


# after every older input, so saved workflows keep their widget order
TWO_EXPERT_INPUTS = {
    "model_low_noise": ("WANMESH_MODEL", {"tooltip": "Wan 2.2 A14B: the low-noise expert (model is then the "
                                                     "high-noise one); none: model runs every step"}),
    **{name: node_input(name) for name in ("boundary", "cfg_low_noise", "start_step", "end_step", "add_noise")},
}


class WanMeshSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANMESH_MODEL", {"tooltip": "the loaded Wan T2V or VACE transformer"}),
                "positive": ("CONDITIONING", {"tooltip": "prompt; VACE contexts (from a VACE encode) ride on it"}),
                "negative": ("CONDITIONING", {"tooltip": "negative prompt (with the same VACE contexts)"}),
                "latent_image": ("LATENT", {"tooltip": "empty latent (or the VACE encode's, or Wan 2.2 TI2V's with "
                                                       "its noise mask) fixing size and length"}),
                "seed": node_input("seed"),
                "steps": node_input("steps"),
                "cfg": node_input("cfg"),
                "shift": node_input("shift"),
                "sampler_name": node_input("sampler", choices=sampler_choices()),
                "denoise": node_input("denoise"),
            },
            # after every older input, so saved workflows keep their widget order
            "optional": {**TWO_EXPERT_INPUTS, "scheduler": node_input("scheduler", choices=scheduler_choices()),
                         "cache": ("WANMESH_CACHE", {"tooltip": "step caching (WanMesh Cache); none: every step "
                                                                "computed"})},
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Samples a Wan video on the worker pool with every parallel mode of the pool; takes VACE "
                   "through the conditioning (WanMesh's or ComfyUI's native VACE encode), one or several contexts.")

    def sample(self, model, positive, negative, latent_image, seed, steps, cfg, shift, sampler_name, denoise,
               model_low_noise=None, boundary=T2V_EXPERT_BOUNDARY, cfg_low_noise=-1.0, start_step=0,
               end_step=END_STEP_TO_THE_END, add_noise=True, scheduler=DEFAULT_SCHEDULER, cache=None):
        check_same_pool(model, model_low_noise)
        end = None if end_step >= steps else end_step
        in_workers = runs_in_the_workers(sampler_name, scheduler)
        for name, conditioning in (("positive", positive), ("negative", negative)):
            # ComfyUI's own samplers (below) act on the sampler keys; the workers' loop acts on none of them
            check_conditioning_keys(conditioning, name, model_inputs_only=not in_workers)
            if carries_family_keys(conditioning):  # the file's header tells the model's class
                check_family_keys(conditioning, native_class_name(model))
        if not in_workers:
            if cache is not None:
                raise ValueError(f"step caching runs with the workers' samplers ({', '.join(SAMPLERS)}); for "
                                 f"{sampler_name} / {scheduler}, give the cache to a WanMesh Native Model instead")
            from .bridge.comfy_sampling import ComfySampling, sample_with_comfyui

            settings = ComfySampling(seed, steps, shift, sampler_name, scheduler, denoise, start_step, end, add_noise)
            return (sample_with_comfyui(model, positive, negative, latent_image, cfg, settings, model_low_noise,
                                        boundary, None if cfg_low_noise < 0 else cfg_low_noise),)
        conditional = read_conditioning(positive, "positive")
        unconditional = read_conditioning(negative, "negative")
        check_same_vace(conditional, unconditional)
        check_text_width(model, conditional.embeddings)
        request = SampleRequest(
            handle=model.handle, latent=latent_to_tensor(latent_image), positive=conditional.embeddings,
            negative=unconditional.embeddings, seed=seed, steps=steps, guidance_scale=cfg, shift=shift,
            sampler=sampler_name, scheduler=scheduler, denoise=denoise, vace_frames=conditional.vace_frames,
            vace_masks=conditional.vace_masks, vace_strengths=conditional.vace_strengths, preview=previews_enabled(model.runner),
            model_loras={expert.handle: list(expert.loras) for expert in (model, model_low_noise) if expert is not None},
            handle_low=None if model_low_noise is None else model_low_noise.handle, boundary=boundary,
            guidance_scale_low=None if cfg_low_noise < 0 else cfg_low_noise, start_step=start_step, end_step=end,
            add_noise=add_noise, timings=True, image_latents=conditional.image_latents,
            image_mask=conditional.image_mask, clip_fea=conditional.clip_fea,
            camera_conditions=conditional.camera_conditions,
            noise_mask=latent_noise_mask(latent_image), cache=cache,
            image_mask_index=conditional.image_mask_index, **model_passes(model, conditional, unconditional),
        )
        request.validate()  # before a layout auto rearranges the pool for it
        arrange_for_job(model, model_input_size(request), steps, cfg)
        timings = RunTimings()
        try:
            run_steps = max(1, min(steps, end_step) - start_step)  # the progress bar covers the steps this run does
            with timings.phase("sampling"):
                reply = model.runner.sample_reply(request, progress=progress_reporter(run_steps),
                                                  should_stop=interrupted)
        except Cancelled:
            raise_if_interrupted()
            raise
        timings.add_sampling(reply.rank_timings)
        logger.info("WanMesh sampler: %s; %s", reply.expert_steps, timings.summary())
        if reply.cache_report:
            logger.info("WanMesh sampler: %s", describe_report(reply.cache_report))
        return (tensor_to_latent(reply.latents, latent_image.get("noise_mask")),)


def model_passes(model, positive, negative) -> dict:
    """The SampleRequest fields of the reference and of what each guidance pass has of its own: its image channels,
    frames after the video's (time_dim_concat), Wan 2.2 Animate inputs, and for a HuMo model its reference (after
    the video's frames) and audio windows."""
    if model.path is None or native_class_name(model) != "WAN21_HuMo":
        return {**negative_image(positive, negative), **animate_passes(positive, negative),
                "reference_latent": positive.reference_latent, "time_latents": positive.time_latents,
                "time_latents_negative": negative.time_latents}
    # HuMo's passes carry different references (the negative's zeros): they ride on time_latents, not ref_conv
    without = [dataclasses.replace(c, reference_latent=None) for c in (positive, negative)]
    return {**negative_image(*without), **animate_passes(positive, negative), **humo_passes(positive, negative)}


def model_input_size(request: SampleRequest) -> torch.Tensor:
    """A stand-in (no data) of the video the model runs: the latent, with the longest pass's frames concatenated
    after it (time_dim_concat), which the auto layout sizes the job by."""
    added = max((t.shape[2] for t in (request.time_latents, request.time_latents_negative) if t is not None), default=0)
    batch, channels, frames, height, width = request.latent.shape
    return torch.empty((batch, channels, frames + added, height, width), device="meta")


def check_text_width(model, embeddings) -> None:
    """The prompt embeddings as wide as the model's text embedding reads (from its header), before any sampling."""
    if model.path is not None and embeddings:
        from ..parallel.validation import check_embedding_width

        check_embedding_width(int(embeddings[0].shape[-1]), model.path, "model", "the positive prompt's embeddings")


def check_same_pool(model, model_low_noise) -> None:
    """Both experts must be resident in the same worker pool (load both with the same pool input)."""
    if model_low_noise is not None and model_low_noise.runner.pool is not model.runner.pool:
        raise ValueError("model and model_low_noise are loaded in different worker pools; connect both loaders "
                         "to the same WanMesh Pool")
