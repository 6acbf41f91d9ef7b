"""Image-to-video on the pool: every model kind (Wan 2.1 I2V with CLIP vision tokens, FLF2V with two images'
tokens, both without CLIP vision tokens as native runs them, the Wan 2.2 I2V A14B-like expert pair) sampled with tp 2, ulysses 2, ring 2 and cfg_parallel 2 equals one
device on the same seed, and the image conditioning changes the result (the comparison could fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pool_helpers import cpu_pool, traceback_deadline
from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.image_to_video import first_last_video, start_image_video
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
WIDTH, HEIGHT, LENGTH = 48, 32, 9
TEXT_WIDTH = 4096  # the image-to-video tiny models are native twins: umT5-XXL's text width
LAYOUTS = {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "cfg_parallel2": dict(cfg_parallel=True)}
NO_CLIP = {"i2v_no_clip": "i2v", "flf2v_no_clip": "flf2v"}  # Wan 2.1 I2V / FLF2V given no CLIP vision tokens
KINDS = ("i2v", "flf2v", "i2v_experts", *NO_CLIP)
TOLERANCE = 1e-4


def _conditioning(kind: str, seed: int = 3) -> dict:
    """The request's image fields: raw latents of a conditioning video, the native mask, CLIP vision tokens."""
    model_kind = NO_CLIP.get(kind, kind)
    generator = torch.Generator().manual_seed(seed)
    frames = (LENGTH - 1) // 4 + 1
    image_latents = torch.randn(1, 16, frames, HEIGHT // 8, WIDTH // 8, generator=generator)
    start = torch.rand(1, 40, 40, 3, generator=generator)  # another aspect than the video: cropped as native
    if model_kind == "flf2v":
        _, mask = first_last_video(start, start.flip(1), WIDTH, HEIGHT, LENGTH)
        tokens = 2 * 257
    else:
        _, mask = start_image_video(start, WIDTH, HEIGHT, LENGTH)
        tokens = 257
    clip = torch.randn(1, tokens, 1280, generator=generator) if kind in ("i2v", "flf2v") else None
    return dict(image_latents=image_latents, image_mask=mask, clip_fea=clip)


def _request(kind: str, handles: dict[str, str], **image) -> P.SampleRequest:
    generator = torch.Generator().manual_seed(5)
    positive, negative = (torch.randn(length, TEXT_WIDTH, generator=generator) for length in (512, 512))
    latent = torch.zeros(1, 16, (LENGTH - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    experts = dict(handle=handles["i2v_high"], handle_low=handles["i2v_low"], boundary=0.9) if kind == "i2v_experts" \
        else dict(handle=handles[NO_CLIP.get(kind, kind)])
    return P.SampleRequest(latent=latent, positive=[positive], negative=[negative], seed=11, steps=3,
                           guidance_scale=4.0, shift=5.0, sampler="euler", **experts, **(image or _conditioning(kind)))


MODELS = ("i2v", "flf2v", "i2v_high", "i2v_low")


def _load(engine, tiny_models) -> dict[str, str]:
    return {name: engine.load_model(str(tiny_models[name])) for name in MODELS}


@pytest.fixture(scope="module")
def one_device(tiny_models) -> dict[str, torch.Tensor]:
    engine = RankExecutor("cpu")
    handles = _load(engine, tiny_models)
    return {kind: engine.sample(_request(kind, handles)) for kind in KINDS} | {
        "other_image": engine.sample(_request("i2v", handles, **_conditioning("i2v", seed=4)))}


@pytest.fixture(scope="module")
def layout_latents(one_device, tiny_models) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    with traceback_deadline(DEADLINE_S):
        for name, layout in LAYOUTS.items():
            with cpu_pool(world=2, **layout) as pool:
                runner = PoolRunner(pool)
                handles = _load(runner, tiny_models)
                latents[name] = {kind: runner.sample(_request(kind, handles)) for kind in KINDS}
    return latents


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layout_equals_one_device(one_device, layout_latents, layout: str, kind: str) -> None:
    torch.testing.assert_close(layout_latents[layout][kind], one_device[kind], rtol=0, atol=TOLERANCE)


def test_the_start_image_changes_the_video(one_device) -> None:
    assert (one_device["i2v"] - one_device["other_image"]).abs().max() > 100 * TOLERANCE


def test_an_image_given_to_a_text_to_video_model_is_refused(tiny_models) -> None:
    engine = RankExecutor("cpu")
    handle = engine.load_model(str(tiny_models["model_native"]))
    request = dataclasses.replace(_request("i2v_experts", {"i2v_high": handle, "i2v_low": handle}), handle_low=None)
    with pytest.raises(ValueError, match="not an image-to-video model"):
        engine.sample(request)


@pytest.mark.parametrize("kind", NO_CLIP)
def test_the_clip_vision_tokens_change_the_video(one_device, kind: str) -> None:
    assert (one_device[kind] - one_device[NO_CLIP[kind]]).abs().max() > 100 * TOLERANCE
