"""Wan 2.2 TI2V 5B on the pool: the tiny 48-channel TI2V transformer sampled with tp 2, ulysses 2, ring 2 and
cfg_parallel 2 equals one device on the same seed, text-to-video and with a start image's noise mask (per-frame
timesteps, each rank's tokens with their own timesteps: the latent's odd height is padded and a frame's tokens are
split between the sequence ranks; with ComfyUI's euler and with Wan's own wan_unipc), and so does a native-MODEL call with per-frame timesteps; the mask changes the
result (the comparison could fail) and keeps the start frame."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pool_helpers import cpu_pool, traceback_deadline
from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.image_to_video import frame_timesteps, latent_noise_mask, wan22_image_latent
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
WIDTH, HEIGHT, LENGTH = 64, 48, 9  # latents [B, 48, 3, 3, 4]: 3 frames of 2 x 2 patches once padded
TEXT_WIDTH = 4096  # the tiny TI2V is a native twin: umT5-XXL's text width
LAYOUTS = {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "cfg_parallel2": dict(cfg_parallel=True)}
CASES = ("t2v", "i2v", "i2v_batch2", "i2v_wan_unipc")
TOLERANCE = 1e-4


def _encoded_start(seed: int = 3) -> torch.Tensor:
    """Stands in for the Wan 2.2 VAE's latents of a start image: one latent frame [1, 48, 1, 3, 4]."""
    return torch.randn(1, 48, 1, HEIGHT // 16, WIDTH // 16, generator=torch.Generator().manual_seed(seed))


def _request(case: str, handle: str, seed: int = 11) -> P.SampleRequest:
    generator = torch.Generator().manual_seed(5)
    positive, negative = (torch.randn(512, TEXT_WIDTH, generator=generator) for _ in range(2))
    batch = 2 if case == "i2v_batch2" else 1
    latent = wan22_image_latent(None if case == "t2v" else _encoded_start(), WIDTH, HEIGHT, LENGTH, batch)
    return P.SampleRequest(handle=handle, latent=latent["samples"], positive=[positive], negative=[negative],
                           seed=seed, steps=3, guidance_scale=4.0, shift=5.0,
                           sampler="wan_unipc" if case == "i2v_wan_unipc" else "euler",
                           noise_mask=latent.get("noise_mask"))


def _forward(handle: str) -> P.ModelForward:
    """A native-MODEL call as ComfyUI's WAN22 makes it with a noise mask: conditional and unconditional rows, per-frame
    timesteps [2, 3] (the kept frame at 0)."""
    generator = torch.Generator().manual_seed(7)
    latent = torch.randn(2, 48, 3, HEIGHT // 16, WIDTH // 16, generator=generator)
    mask = latent_noise_mask(wan22_image_latent(_encoded_start(), WIDTH, HEIGHT, LENGTH, 1)["noise_mask"],
                             tuple(latent.shape))
    return P.ModelForward(handle=handle, latent=latent, timestep=frame_timesteps(mask, torch.tensor([937.5])),
                          context=torch.randn(2, 512, TEXT_WIDTH, generator=generator))


@pytest.fixture(scope="module")
def one_device(tiny_models) -> dict[str, torch.Tensor]:
    engine = RankExecutor("cpu")
    handle = engine.load_model(str(tiny_models["ti2v"]))
    results = {case: engine.sample(_request(case, handle)) for case in CASES}
    results["forward"] = engine.forward(_forward(handle))
    results["i2v_unmasked"] = engine.sample(dataclasses.replace(_request("i2v", handle), noise_mask=None))
    return results


@pytest.fixture(scope="module")
def layout_latents(one_device, tiny_models) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    with traceback_deadline(DEADLINE_S):
        for name, layout in LAYOUTS.items():
            with cpu_pool(world=2, **layout) as pool:
                runner = PoolRunner(pool)
                handle = runner.load_model(str(tiny_models["ti2v"]))
                latents[name] = {case: runner.sample(_request(case, handle)) for case in CASES}
                latents[name]["forward"] = runner.forward(_forward(handle))
    return latents


@pytest.mark.parametrize("case", (*CASES, "forward"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layout_equals_one_device(one_device, layout_latents, layout: str, case: str) -> None:
    torch.testing.assert_close(layout_latents[layout][case], one_device[case], rtol=0, atol=TOLERANCE)


def test_the_mask_keeps_the_start_frame_and_changes_the_video(one_device) -> None:
    start = _encoded_start()
    masked, unmasked = one_device["i2v"], one_device["i2v_unmasked"]
    assert (masked[:, :, :1] - start).abs().max() <= 1e-5
    assert (one_device["i2v_wan_unipc"][:, :, :1] - start).abs().max() <= 1e-5
    assert (unmasked[:, :, :1] - start).abs().max() > 100 * TOLERANCE
    assert (masked[:, :, 1:] - unmasked[:, :, 1:]).abs().max() > 100 * TOLERANCE
    assert not torch.equal(one_device["i2v_batch2"][0], one_device["i2v_batch2"][1])  # each row its own noise
