"""The single-device sampler against diffusers' own Wan pipeline, plus denoise, VACE, progress, cancel and errors."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline

from wanmesh.parallel.worker.executors import RankExecutor
from wanmesh.parallel.weights.loaders import load_transformer, load_vae
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.errors import Cancelled
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.latents import denormalize_latents
from wanmesh.parallel.sampling.loop import pad_to_wan_text_length, sample, text_context

WIDTH, HEIGHT, FRAMES = 64, 48, 5


def _embeddings(dim: int, seed: int, length: int) -> list[torch.Tensor]:
    return [torch.randn(length, dim, generator=torch.Generator().manual_seed(seed))]


def _request(text_dim: int, **overrides) -> SampleRequest:
    fields = dict(
        handle="model|unused",
        latent=torch.zeros(latent_shape(WIDTH, HEIGHT, FRAMES)),
        positive=[pad_to_wan_text_length(e) for e in _embeddings(text_dim, 1, 7)],  # as WanMesh's text encoder gives
        negative=[pad_to_wan_text_length(e) for e in _embeddings(text_dim, 2, 3)],
        seed=123, steps=4, guidance_scale=5.0, shift=3.0, sampler="unipc",
    )
    fields.update(overrides)
    return SampleRequest(**fields)


@pytest.fixture(scope="module")
def t2v(tiny_models):
    return load_transformer(str(tiny_models["t2v"]))


def _diffusers_scheduler(sampler: str, shift: float):
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


@pytest.mark.parametrize("sampler", ["unipc", "wan_unipc"])
def test_matches_diffusers_wan_pipeline(tiny_models, t2v, sampler):
    """Same weights, scheduler, seed and prompt embeddings: WanMesh's latents equal WanPipeline's with Wan's
    reference flow UniPC (its name and its older alias). ComfyUI's samplers are compared with ComfyUI's."""
    request = _request(t2v.config.text_dim, sampler=sampler)
    ours = sample(t2v, request)

    folder = tiny_models["diffusers_t2v"]
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None,
        transformer=load_transformer(str(folder)), vae=load_vae(str(folder)),
        scheduler=_diffusers_scheduler(sampler, request.shift),
    )
    reference = pipe(
        prompt_embeds=text_context(request.positive, 1, torch.float32, "cpu"),
        negative_prompt_embeds=text_context(request.negative, 1, torch.float32, "cpu"),
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale, generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent",
    ).frames
    reference = denormalize_latents(reference)
    assert ours.shape == reference.shape == request.latent.shape
    assert ours.std() > 0.1, "degenerate output would make the comparison meaningless"
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)


def test_same_seed_same_result_other_seed_differs(t2v):
    first = sample(t2v, _request(t2v.config.text_dim))
    again = sample(t2v, _request(t2v.config.text_dim))
    other = sample(t2v, _request(t2v.config.text_dim, seed=124))
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-2


def test_cfg_one_uses_only_the_positive_prompt(t2v):
    request = _request(t2v.config.text_dim, guidance_scale=1.0)
    swapped = _request(t2v.config.text_dim, guidance_scale=1.0, negative=_embeddings(t2v.config.text_dim, 99, 5))
    assert torch.equal(sample(t2v, request), sample(t2v, swapped))


def test_small_denoise_stays_near_the_input_latent(t2v):
    source = torch.randn(latent_shape(WIDTH, HEIGHT, FRAMES), generator=torch.Generator().manual_seed(5)) * 2
    full = sample(t2v, _request(t2v.config.text_dim, latent=source, sampler="euler", steps=2))
    light = sample(t2v, _request(t2v.config.text_dim, latent=source, sampler="euler", steps=2, denoise=0.05))
    ignored = sample(t2v, _request(t2v.config.text_dim, latent=source * 0, sampler="euler", steps=2))
    assert torch.equal(full, ignored), "denoise 1 must not depend on the input latent"
    # ComfyUI's denoise: the last 2 of int(2 / 0.05) = 40 steps, starting near sigma 0.14 at shift 3
    assert (light - source).abs().mean() < 0.2 * (full - source).abs().mean()


def test_vace_strength_zero_equals_t2v_and_context_matters(tiny_models, t2v):
    vace = load_transformer(str(tiny_models["vace"]))
    shape = list(latent_shape(WIDTH, HEIGHT, FRAMES))
    generator = torch.Generator().manual_seed(9)
    context = {"vace_frames": [torch.randn([1, 32] + shape[2:], generator=generator)],
               "vace_masks": [torch.rand([1, 64] + shape[2:], generator=generator)]}
    plain = sample(t2v, _request(t2v.config.text_dim))
    off = sample(vace, _request(t2v.config.text_dim, **context, vace_strengths=[0.0]))
    on = sample(vace, _request(t2v.config.text_dim, **context, vace_strengths=[1.0]))
    torch.testing.assert_close(off, plain, rtol=0, atol=1e-5)
    assert (on - plain).abs().max() > 1e-3


def test_progress_every_step_and_cancel_at_a_step_boundary(t2v):
    seen = []
    sample(t2v, _request(t2v.config.text_dim), progress=lambda step, total: seen.append((step, total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    seen.clear()
    with pytest.raises(Cancelled, match="before step 3 of 4"):
        sample(t2v, _request(t2v.config.text_dim), progress=lambda s, t: seen.append(s), should_stop=lambda: len(seen) >= 2)
    assert seen == [1, 2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sampler": "ddim"}, "valid samplers: unipc, euler"),
        ({"steps": 0}, "steps must be at least 1"),
        ({"denoise": 1.5}, r"denoise must be in \(0, 1\]"),
        ({"latent": torch.zeros(1, 4, 2, 6, 8)}, r"latent must be \[B, 16"),
    ],
)
def test_bad_requests_are_rejected(t2v, overrides, message):
    with pytest.raises(ValueError, match=message):  # the driver's check, before anything is sent to a worker
        _request(t2v.config.text_dim, **overrides).validate()


def test_engine_rejects_mismatched_conditioning_and_vace(tiny_models, t2v):
    engine = RankExecutor("cpu")
    handle = engine.load_model(str(tiny_models["t2v"]))
    with pytest.raises(ValueError, match="takes text embeddings of width 64"):
        engine.sample(_request(4096, handle=handle))
    shape = list(latent_shape(WIDTH, HEIGHT, FRAMES))
    with pytest.raises(ValueError, match="the model has no VACE blocks"):
        engine.sample(_request(64, handle=handle, vace_frames=[torch.zeros([1, 32] + shape[2:])],
                               vace_masks=[torch.ones([1, 64] + shape[2:])], vace_strengths=[1.0]))
    with pytest.raises(KeyError, match="load it first"):
        engine.sample(_request(64, handle="model|missing||torch.float32"))


def test_engine_keeps_models_resident(tiny_models):
    engine = RankExecutor("cpu")
    first = engine.load_model(str(tiny_models["t2v"]))
    assert engine.load_model(str(tiny_models["t2v"])) == first
    assert engine.loaded() == [first]
    engine.unload(first)
    assert engine.loaded() == []
