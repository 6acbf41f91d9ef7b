"""VACE on the pool: the encode with VAE patch parallelism (2 ranks sharing tiles) equals the one-rank tiled
encode, and VACE sampling from that conditioning with CFG parallel equals one device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pool_helpers import cpu_pool, random_prompt_request, tiny_models_within
from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 500
WIDTH, HEIGHT, LENGTH = 64, 48, 9
TILE = dict(tile_px=32, overlap_px=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _inputs() -> dict:
    generator = torch.Generator().manual_seed(2)
    video = torch.rand(5, 40, 80, 3, generator=generator)  # fewer frames and another aspect than the canvas
    masks = torch.zeros(5, 40, 80)
    masks[:, 10:30, 20:60] = 1.0
    references = torch.rand(2, HEIGHT, WIDTH, 3, generator=generator)
    return dict(width=WIDTH, height=HEIGHT, length=LENGTH, control_video=video, control_masks=masks,
                reference_images=references)


def _sample_request(handle: str, encoded: P.VaceEncoded) -> P.SampleRequest:
    return random_prompt_request(torch.zeros(1, 16, *encoded.frames.shape[2:]), torch.Generator().manual_seed(4),
                                 (5, 3), handle=handle, seed=9, steps=3, guidance_scale=4.0, shift=3.0,
                                 vace_frames=[encoded.frames] * 2, vace_masks=[encoded.mask] * 2,
                                 vace_strengths=[1.0, 0.5])


def test_vace_encode_with_vae_patch_and_sampling_with_cfg_parallel_equal_one_device(tiny, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    one = RankExecutor("cpu")
    vae, model = one.load_vae(tiny["vae"]), one.load_model(tiny["vace"])
    frames, mask, trim = one.encode_vace(P.EncodeVace(handle=vae, **_inputs(), **TILE))
    expected = P.VaceEncoded(frames, mask, trim)
    expected_latents = one.sample(_sample_request(model, expected))

    with cpu_pool(world=2, cfg_parallel=True, vae_patch=2) as pool:
        runner = PoolRunner(pool)
        encoded = runner.encode_vace(P.EncodeVace(handle=runner.load_vae(tiny["vae"]), **_inputs(), **TILE))
        previews = []
        request = dataclasses.replace(_sample_request(runner.load_model(tiny["vace"]), encoded), preview=True)
        latents = runner.sample(request, progress=lambda step, total, preview=None: previews.append((step, preview)))
    assert encoded.trim_latent == 2 and list(encoded.frames.shape) == [1, 32, 2 + 3, 6, 8]
    torch.testing.assert_close(encoded.frames, expected.frames, rtol=0, atol=1e-5)
    torch.testing.assert_close(encoded.mask, expected.mask, rtol=0, atol=0)
    torch.testing.assert_close(latents, expected_latents, rtol=0, atol=1e-4)
    assert [step for step, _ in previews] == [1, 2, 3], "one progress report per step"
    assert all(p is not None and p.shape == (6, 8, 3) for _, p in previews), "rank 0 sends a preview with each step"


def test_vace_encode_input_errors_come_from_the_driver_before_any_worker_work(tiny):
    class NoPool:
        def call(self, request):
            raise AssertionError("a bad VACE input reached the pool")

    runner = PoolRunner(NoPool())
    bad = dict(_inputs(), control_masks=torch.full((5, 40, 80), 1.5))
    with pytest.raises(ValueError, match="1.5"):
        runner.encode_vace(P.EncodeVace(handle="vae|x", **bad))
    with pytest.raises(ValueError, match="100"):
        runner.encode_vace(P.EncodeVace(handle="vae|x", **dict(_inputs(), width=100)))
