"""The flow-matching denoising loop for Wan 2.1, VACE and Wan 2.2 (samplers, schedules, denoise < 1); runs in the
workers.

Latents enter and leave as raw Wan VAE latents (ComfyUI's convention); the loop works on latents normalised with the
latent mean/std of their VAE (``latents.py``: 16 channels Wan 2.1, 48 Wan 2.2); guidance is ``guidance.py``'s. Two
families of samplers: ComfyUI's (``solvers.py`` on a ``schedules.py`` sigma schedule, each model call turned into a
clean-latent estimate, the start noise and the leftover-noise result scaled as ComfyUI's KSampler does; a Wan 2.2
latent's noise mask handled as ComfyUI's ``KSamplerX0Inpaint`` with the WAN22 model: the kept latent blended into
each model input and output, per-frame timesteps), and Wan's reference flow UniPC (diffusers' scheduler configured
as Wan's code samples; a noise mask handled as Wan 2.2's own TI2V code does: the kept latent blended into the start
latent and into every step's result, per-frame timesteps). The model is any callable with the diffusers Wan
transformer signature, so parallel wrappers plug in unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from ..config import (COMFY_SAMPLERS, DISCARD_PENULTIMATE_SIGMA, LATENT_CHANNELS, SAMPLERS, TEXT_TOKENS, WAN_UNIPC,
                      WAN_UNIPC_ALIAS, check_noise_mask)
from ..errors import Cancelled
from ..image_to_video import frame_timesteps, image_concat, latent_noise_mask
from ..protocol import SampleRequest
from .experts import Experts
from .guidance import PASS_INPUTS, TIME_CONCAT, guided_prediction
from ..vace.context import default_vace_context, vace_model_context
from .forward import (animate_inputs, audio_inputs, camera_inputs, check_latent_for_model, image_concat_input, image_inputs,
                      latent_channels, vace_call_inputs, vace_layers_of)
from .preview import denoised_estimate, preview_image
from .schedules import TIMESTEP_SCALE, run_sigmas
from .solvers import solve
from .latents import (LATENTS_MEAN, LATENTS_STD, WAN22_MEAN, WAN22_STD, check_finite, denormalize_latents,
                      model_space_latents, normalize_latents, seeded_noise)
from ..networks.reference import REFERENCE_KEYWORD



def make_scheduler(sampler: str, shift: float):
    """A fresh diffusers scheduler for Wan flow matching with the given shift: Wan's reference UniPC, or the plain
    flow Euler the benchmarks time."""
    if sampler in (WAN_UNIPC, WAN_UNIPC_ALIAS):
        return UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
        )
    if sampler == "flow_euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    raise ValueError(f"sampler {sampler!r} is unknown; valid samplers: {', '.join(SAMPLERS)}")


def pad_to_wan_text_length(embedding: torch.Tensor) -> torch.Tensor:
    """One prompt embedding [L, D] as the Wan reference and diffusers' WanPipeline feed it: cut or zero-padded
    to 512 tokens. WanMesh's text encoder returns this; conditioning from elsewhere is used as given."""
    embedding = embedding[:TEXT_TOKENS]
    return torch.cat([embedding, embedding.new_zeros(TEXT_TOKENS - embedding.shape[0], embedding.shape[1])])


def text_context(embeddings: list[torch.Tensor], batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Prompt embeddings stacked to [batch, L, D] as given (ComfyUI does not pad conditioning); one prompt is
    repeated over the batch, and prompts of different lengths are zero-padded to the longest."""
    if len(embeddings) not in (1, batch):
        raise ValueError(f"got {len(embeddings)} prompt embeddings for a batch of {batch}; give 1 or {batch}")
    longest = max(emb.shape[0] for emb in embeddings)
    rows = [torch.cat([emb.float(), emb.new_zeros(longest - emb.shape[0], emb.shape[1]).float()]) for emb in embeddings]
    context = torch.stack(rows)
    if context.shape[0] != batch:
        context = context.expand(batch, -1, -1)
    return context.to(device=device, dtype=dtype)


@dataclass
class _Schedule:
    scheduler: object
    timesteps: torch.Tensor  # the timesteps this run steps through (start_step .. end_step - 1)
    start_sigma: float
    first_step: int = 0  # the step number of timesteps[0], counted over the request's `steps`


def _schedule(request: SampleRequest) -> _Schedule:
    """Timesteps for `steps` steps; with denoise < 1, the last `steps` of a longer schedule (as ComfyUI does); of
    those, the steps from start_step up to end_step (ComfyUI's advanced sampler; see experts.py)."""
    scheduler = make_scheduler(request.sampler, request.shift)
    total = request.steps if request.denoise >= 1.0 else max(request.steps, int(request.steps / request.denoise))
    scheduler.set_timesteps(total, device="cpu")
    begin = total - request.steps
    first = begin + request.start_step
    stop = begin + (request.steps if request.end_step is None else request.end_step)
    scheduler.set_begin_index(first)
    return _Schedule(scheduler, scheduler.timesteps[first:stop], float(scheduler.sigmas[first]), request.start_step)


def schedule_timesteps(request: SampleRequest) -> tuple[torch.Tensor, int]:
    """(the timesteps a request steps through, the step number of the first): what the expert report needs."""
    if request.sampler in COMFY_SAMPLERS:
        return run_sigmas_of(request)[:-1] * TIMESTEP_SCALE, request.start_step
    schedule = _schedule(request)
    return schedule.timesteps, schedule.first_step


def run_sigmas_of(request: SampleRequest) -> torch.Tensor:
    return run_sigmas(request.scheduler, request.steps, request.shift, request.denoise, request.start_step,
                      request.end_step, discard_penultimate=request.sampler in DISCARD_PENULTIMATE_SIGMA)


def initial_latents(request: SampleRequest, start_sigma: float, rows: range) -> torch.Tensor:
    """Seeded noise for the whole batch (so any subset of rows matches one device), mixed with the input latent
    at the first step's noise level; without add_noise the input latent already holds that noise."""
    if not request.add_noise:
        return normalize_latents(request.latent[rows.start : rows.stop])
    noise = seeded_noise(tuple(request.latent.shape), request.seed)[rows.start : rows.stop]
    if request.denoise >= 1.0 and request.start_step == 0:
        return noise
    source = normalize_latents(request.latent[rows.start : rows.stop])
    return start_sigma * noise + (1.0 - start_sigma) * source


def sample(
    model: Callable,
    request: SampleRequest,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    rows: range | None = None,
    guidance: Callable | None = None,
    preview: Callable | None = None,
    low_model: Callable | None = None,
    step_cache=None,
) -> torch.Tensor:
    """Run the denoising loop and return raw latents [B, 16 or 48, T, h, w] (float32, CPU).

    `rows` samples only those batch rows (a data-parallel share); an empty share still follows every step so
    that collective progress and cancel checks stay in step with the other replicas. `guidance` replaces
    `guided_prediction` (same signature), e.g. to split the CFG passes over ranks. `preview` receives a small
    RGB image of the denoised estimate at every step, before that step's progress call. `low_model` is the
    low-noise expert of a two-expert run (``experts.py`` says which steps it runs); both share one architecture.
    ``step_cache`` (``step_cache.StepCaches``, installed on the models) is told each step before its model calls.
    Progress counts the steps this run covers (start_step up to end_step)."""
    check_latent_for_model(model, request.latent.shape[1])
    check_noise_mask(request.noise_mask, tuple(request.latent.shape), request.sampler)
    if request.sampler in COMFY_SAMPLERS:
        return sample_with_solver(model, request, device=device, dtype=dtype, progress=progress,
                                  should_stop=should_stop, rows=rows, guidance=guidance, preview=preview,
                                  low_model=low_model, step_cache=step_cache)
    schedule = _schedule(request)
    experts = Experts.for_request(model, low_model, request)
    rows = range(request.latent.shape[0]) if rows is None else rows
    positive = _rows(text_context(request.positive, request.latent.shape[0], dtype, device), rows)
    negative = None
    if experts.needs_negative:
        negative = _rows(text_context(request.negative, request.latent.shape[0], dtype, device), rows)
    extra = conditioning_inputs(model, request, rows, dtype, device)
    latents = initial_latents(request, schedule.start_sigma, rows).to(device)
    kept = KeptLatent.of(request, normalize_latents(request.latent[rows.start : rows.stop]).to(device), rows, device)
    latents = kept.output(latents)  # Wan 2.2 TI2V: the start image's latent frames are never noised
    run_steps = len(schedule.timesteps)
    for index, t in enumerate(schedule.timesteps):
        step = schedule.first_step + index + 1  # 1-based over the whole schedule, for messages
        if should_stop is not None and should_stop():
            raise Cancelled(f"sampling cancelled before step {step} of {request.steps}")
        if len(rows):
            expert = experts.at(t)
            step_negative = negative if expert.guidance_scale != 1.0 else None
            model_t = t if kept.mask is None else kept.model_input(latents, t.reshape(1))[1]
            if step_cache is not None:
                step_cache.at_step(step - 1, request.steps, 1 if step_negative is None else 2)
            prediction = (guidance or guided_prediction)(
                expert.model, latents.to(dtype), model_t, positive, step_negative, expert.guidance_scale, extra
            )
            if preview is not None:
                preview(preview_image(denoised_estimate(latents, prediction, t)))
            latents = kept.output(schedule.scheduler.step(prediction.float(), t, latents, return_dict=False)[0])
            check_finite(latents, step, request.steps)
        if progress is not None:
            progress(index + 1, run_steps)
    return denormalize_latents(latents).cpu()


def sample_with_solver(model: Callable, request: SampleRequest, *, device, dtype, progress, should_stop, rows,
                       guidance, preview, low_model, step_cache=None) -> torch.Tensor:
    """``sample`` for ComfyUI's samplers, as ComfyUI's KSampler runs them: the start latent noised to the first
    sigma (``sigma * noise + (1 - sigma) * latent``), one clean-latent estimate per step, the result divided by
    ``1 - sigma`` of the last sigma (leftover noise of an ``end_step`` run), raw latents out."""
    batch = request.latent.shape[0]
    rows = range(batch) if rows is None else rows
    sigmas = run_sigmas_of(request)
    if len(sigmas) < 2:  # start_step at or past the end: nothing to run, the input comes back (as ComfyUI's)
        return request.latent[rows.start : rows.stop].float().cpu()
    experts = Experts.for_request(model, low_model, request)
    positive = _rows(text_context(request.positive, batch, dtype, device), rows)
    negative = (_rows(text_context(request.negative, batch, dtype, device), rows)
                if experts.needs_negative else None)
    extra = conditioning_inputs(model, request, rows, dtype, device)
    start = model_space_latents(request.latent)[rows.start : rows.stop].to(device)
    noise = (seeded_noise(tuple(request.latent.shape), request.seed)[rows.start : rows.stop].to(device)
             if request.add_noise else torch.zeros_like(start))
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * start
    step_noise = ancestral_noise(request.seed, tuple(request.latent.shape), rows, device)
    run_steps = len(sigmas) - 1
    kept = KeptLatent.of(request, start, rows, device)

    def denoise(index: int, latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        step = request.start_step + index + 1  # 1-based over the whole schedule, for messages
        if should_stop is not None and should_stop():
            raise Cancelled(f"sampling cancelled before step {step} of {request.steps}")
        if not len(rows):
            progress is not None and progress(index + 1, run_steps)
            return latents
        t = (sigma * TIMESTEP_SCALE).reshape(1).to(device)
        expert = experts.at(t)
        latents, model_t = kept.model_input(latents, t)
        if step_cache is not None:
            step_cache.at_step(step - 1, request.steps, 2 if negative is not None and expert.guidance_scale != 1.0
                               else 1)
        prediction = (guidance or guided_prediction)(
            expert.model, latents.to(dtype), model_t, positive, negative if expert.guidance_scale != 1.0 else None,
            expert.guidance_scale, extra).float()
        denoised = kept.output(latents - prediction * sigma.to(device))
        check_finite(denoised, step, request.steps)
        if preview is not None:
            preview(preview_image(denoised))
        if progress is not None:
            progress(index + 1, run_steps)
        return denoised

    sigmas = sigmas.to(device)
    if not len(rows):  # a replica without rows follows every step for the collective stop checks
        for index in range(run_steps):
            denoise(index, x, sigmas[index])
        return x.cpu()
    x = solve(request.sampler, denoise, x, sigmas, step_noise)  # uni_pc may turn a final sigma of 0 into 0.001
    check_finite(x, request.start_step + run_steps, request.steps)
    return denormalize_latents(x / (1.0 - sigmas[-1])).cpu()


@dataclass
class KeptLatent:
    """A noise mask's part of ComfyUI's ``KSamplerX0Inpaint`` with Wan 2.2's WAN22 model: where the mask is 0 the
    start latent (normalised) replaces the model input and the denoised output; every latent frame's timestep is
    the mask's mean over that frame times the step's timestep. Without a mask both pass through."""

    mask: torch.Tensor | None = None  # [rows, C, T, h, w], the noise mask resized to the latent
    latent: torch.Tensor | None = None  # the start latent's rows, normalised

    @classmethod
    def of(cls, request: SampleRequest, start: torch.Tensor, rows: range, device) -> "KeptLatent":
        if request.noise_mask is None:
            return cls()
        mask = latent_noise_mask(request.noise_mask, tuple(request.latent.shape))[rows.start : rows.stop]
        return cls(mask.to(device), start)

    def model_input(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the model input, its timestep: the step's, or one per row and latent frame)."""
        if self.mask is None:
            return x, t
        return self._blend(x), frame_timesteps(self.mask, t)

    def output(self, denoised: torch.Tensor) -> torch.Tensor:
        return denoised if self.mask is None else self._blend(denoised)

    def _blend(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask + self.latent * (1.0 - self.mask)  # ComfyUI's order of operations


def ancestral_noise(seed: int, shape: tuple[int, ...], rows: range, device) -> Callable[[], torch.Tensor]:
    """Noise for the steps of ancestral samplers, drawn as ComfyUI draws it: a generator on the latent's device seeded
    with the sampler seed, plus one on the CPU (ComfyUI 0.33's ``default_noise_sampler``: there the initial noise
    comes from a CPU generator with the seed itself, which the steps would otherwise repeat), the whole batch each
    time (so a replica's rows match one device's), float32."""
    on_cpu = torch.device(device).type == "cpu"
    generator = torch.Generator(device=device).manual_seed(int(seed) + (1 if on_cpu else 0))

    def draw() -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)[rows.start : rows.stop]

    return draw


def _rows(tensor: torch.Tensor, rows: range) -> torch.Tensor:
    return tensor[rows.start : rows.stop]


def conditioning_inputs(model, request: SampleRequest, rows: range, dtype, device) -> dict:
    """The model inputs beside latents, timestep and text: VACE contexts, image-to-video inputs, the Fun Camera
    embedding, and the inputs each guidance pass has of its own (``guidance.PASS_INPUTS``): frames concatenated in
    time, the negative pass's own image channels and each pass's Wan 2.2 Animate pose latents and face video."""
    shape = tuple(request.latent.shape)
    mean, std = model_latent_stats(model)
    concat = image_channels(model, request.image_latents, request.image_mask, request.image_mask_index, shape)
    inputs = {**vace_model_inputs(model, request, rows, dtype, device),
              **image_inputs(model, concat, request.clip_fea, rows, shape, dtype, device),
              **reference_input(request.reference_latent, mean, std, rows, shape[0], dtype, device),
              **camera_inputs(model, request.camera_conditions, rows, shape[0], dtype, device)}
    passes = time_concat_inputs(request, rows, dtype, device)
    if request.image_latents_negative is not None:
        negative = image_channels(model, request.image_latents_negative, request.image_mask_negative,
                                  request.image_mask_index, shape)
        passes[1].update(image_concat_input(model, negative, rows, shape, dtype, device))
    for one_pass, animate in zip(passes, animate_pass_inputs(model, request, rows, dtype, device)):
        one_pass.update(animate)
    for one_pass, audio in zip(passes, (request.audio_embed, request.audio_embed_negative)):
        one_pass.update(audio_inputs(model, audio, rows, shape[0], dtype, device))
    if any(passes):
        inputs[PASS_INPUTS] = tuple(passes)
    return inputs


def animate_pass_inputs(model, request: SampleRequest, rows: range, dtype, device) -> list[dict]:
    """Each guidance pass's Wan 2.2 Animate inputs (WAN22_Animate's: the pose latents normalised, the face video as
    given); the model computes a pass's face tokens once per run and keeps them (``networks/wan_animate.py``)."""
    batch = request.latent.shape[0]

    def one_pass(pose: torch.Tensor | None, face: torch.Tensor | None) -> dict:
        pose = None if pose is None else normalize_latents(pose)
        return animate_inputs(model, pose, face, rows, batch, dtype, device)

    return [one_pass(request.pose_latents, request.face_pixels),
            one_pass(request.pose_latents_negative, request.face_pixels_negative)]


def image_channels(model, image_latents: torch.Tensor | None, image_mask: torch.Tensor | None, mask_index: int,
                   shape: tuple) -> torch.Tensor | None:
    """The image channels of an image-to-video model input, built as ComfyUI's Wan ``concat_cond`` builds them."""
    if image_latents is None:
        return None
    config = getattr(model, "config", None)
    extra_channels = getattr(config, "in_channels", LATENT_CHANNELS) - latent_channels(model)
    mean, std = model_latent_stats(model)
    # ComfyUI's WAN21 of an image-token model and its WAN22 (48-channel latents) are image-to-video models
    image_to_video = bool(getattr(config, "image_dim", None)) or latent_channels(model) != LATENT_CHANNELS
    image_to_video = image_to_video and not getattr(config, "camera_in_channels", None)  # WAN21_Camera's
    return image_concat(image_latents, image_mask, shape, mean, std, extra_channels=extra_channels,
                        image_to_video=image_to_video, mask_index=mask_index)


def time_concat_inputs(request: SampleRequest, rows: range, dtype, device) -> list[dict]:
    """Each guidance pass's latents after the sampled frames (ComfyUI's ``time_dim_concat``), normalised as
    ComfyUI's Wan model takes them: [the conditional pass's inputs, the unconditional pass's]."""
    batch = request.latent.shape[0]

    def one_pass(raw: torch.Tensor | None) -> dict:
        if raw is None:
            return {}
        rows_of = raw.expand(batch, *raw.shape[1:]) if raw.shape[0] == 1 else raw
        return {TIME_CONCAT: normalize_latents(rows_of[rows.start : rows.stop]).to(device=device, dtype=dtype)}

    return [one_pass(request.time_latents), one_pass(request.time_latents_negative)]


def model_latent_stats(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and std (flat) of the latent space the model samples: Wan 2.1's (16 channels) or Wan 2.2's (48)."""
    if latent_channels(model) == LATENT_CHANNELS:
        return LATENTS_MEAN.flatten(), LATENTS_STD.flatten()
    return WAN22_MEAN.flatten(), WAN22_STD.flatten()


def reference_input(reference: torch.Tensor | None, mean, std, rows: range, batch: int, dtype, device) -> dict:
    """The Wan 2.2 Fun reference of the given rows as ComfyUI's WAN21 hands it to the model: the raw reference
    latent normalised, its first frame, repeated to the batch (``repeat_to_batch_size``); none without one."""
    if reference is None:
        return {}
    first = (reference[:, :, 0].float() - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    first = first.repeat(-(-batch // first.shape[0]), 1, 1, 1)[:batch]
    return {REFERENCE_KEYWORD: first[rows.start : rows.stop].to(device=device, dtype=dtype)}


def vace_model_inputs(model, request: SampleRequest, rows: range, dtype, device) -> dict:
    """Keyword arguments that feed the VACE contexts to a VACE model; none for T2V. A VACE model given no VACE
    conditioning gets the native default context (zero latents, an all-ones mask)."""
    vace_layers = vace_layers_of(model, bool(request.vace_frames))
    if vace_layers is None:
        return {}
    mean, std = LATENTS_MEAN.flatten(), LATENTS_STD.flatten()
    batch, _, frames, h, w = request.latent.shape
    if request.vace_frames:
        contexts = vace_model_context(request.vace_frames, request.vace_masks, mean, std, batch=batch)
        strengths = [float(s) for s in request.vace_strengths]
    else:
        contexts, strengths = default_vace_context(batch, frames, h, w, mean, std), [1.0]
    return vace_call_inputs(_rows(contexts, rows), strengths, len(vace_layers), dtype, device)
