"""Wan 2.2 Fun Control A14B on the pool: the reference image's tokens (a leading latent frame) under ring 2 and
Ulysses 2 equal one device, for a WanMesh Sampler request (control latents, the mask at channel 16, a raw reference
latent) and for a native-MODEL call (ComfyUI's concatenated input and normalised reference). The latent is sized so
that the video and reference tokens (3 frames of 1 x 3 patches: 9) do not split evenly over two ranks, and the
reference changes the result (the comparison could fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pool_helpers import cpu_pool, traceback_deadline
from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
LATENT = (1, 16, 2, 2, 6)  # 2 frames of 1 x 3 patches, plus the reference frame: 9 tokens
TEXT_WIDTH = 4096
LAYOUTS = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2)}
TOLERANCE = 1e-4


def _request(handle: str, reference: bool = True) -> P.SampleRequest:
    generator = torch.Generator().manual_seed(5)
    positive, negative = (torch.randn(24, TEXT_WIDTH, generator=generator) for _ in range(2))
    _, _, frames, h, w = LATENT
    return P.SampleRequest(
        handle=handle, latent=torch.zeros(LATENT), positive=[positive], negative=[negative], seed=11, steps=2,
        guidance_scale=4.0, shift=5.0, sampler="euler",
        image_latents=torch.randn(1, 32, frames, h, w, generator=generator), image_mask=torch.ones(1, 4, frames, h, w),
        image_mask_index=16,
        reference_latent=torch.randn(1, 16, 1, h, w, generator=generator) if reference else None)


def _forward(handle: str) -> P.ModelForward:
    generator = torch.Generator().manual_seed(7)
    _, _, frames, h, w = LATENT
    return P.ModelForward(handle=handle, latent=torch.randn(2, 52, frames, h, w, generator=generator),
                          timestep=torch.tensor([900.0, 900.0]), context=torch.randn(2, 24, TEXT_WIDTH, generator=generator),
                          reference_latent=torch.randn(2, 16, h, w, generator=generator))


@pytest.fixture(scope="module")
def one_device(tiny_models) -> dict[str, torch.Tensor]:
    engine = RankExecutor("cpu")
    handle = engine.load_model(str(tiny_models["fun22_control"]))
    return {"sample": engine.sample(_request(handle)), "forward": engine.forward(_forward(handle)),
            "no_reference": engine.sample(_request(handle, reference=False)),
            "forward_no_reference": engine.forward(dataclasses.replace(_forward(handle), reference_latent=None))}


@pytest.fixture(scope="module")
def layout_results(tiny_models) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    with traceback_deadline(DEADLINE_S):
        for name, layout in LAYOUTS.items():
            with cpu_pool(world=2, **layout) as pool:
                runner = PoolRunner(pool)
                handle = runner.load_model(str(tiny_models["fun22_control"]))
                results[name] = {"sample": runner.sample(_request(handle)), "forward": runner.forward(_forward(handle))}
    return results


def test_the_reference_changes_the_result(one_device) -> None:
    assert (one_device["sample"] - one_device["no_reference"]).abs().max() > 100 * TOLERANCE
    assert (one_device["forward"] - one_device["forward_no_reference"]).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("case", ("sample", "forward"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_parallel_with_a_reference_equals_one_device(one_device, layout_results, layout: str,
                                                              case: str) -> None:
    difference = (layout_results[layout][case] - one_device[case]).abs().max().item()
    assert difference <= TOLERANCE, f"{layout} {case}: {difference:.3g} from one device"
