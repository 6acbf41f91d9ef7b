"""Sampler previews: an image of the latent's size whose content follows the denoised estimate across steps,
made only on request, on rank 0, and attached to that step's progress."""

from __future__ import annotations

import numpy as np
import torch

from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import pad_to_wan_text_length, sample
from wanmesh.parallel.sampling.preview import WAN21_LATENT_RGB, WAN21_LATENT_RGB_BIAS, preview_image
from wanmesh.parallel.worker.runtime import StepReporter

SHAPE = latent_shape(64, 48, 9)


def _request(**overrides) -> SampleRequest:
    generator = torch.Generator().manual_seed(1)
    fields = dict(handle="model|x", latent=torch.zeros(SHAPE), seed=3, steps=4, guidance_scale=3.0, shift=3.0,
                  positive=[pad_to_wan_text_length(torch.randn(5, 64, generator=generator))],
                  negative=[pad_to_wan_text_length(torch.randn(2, 64, generator=generator))], preview=True)
    fields.update(overrides)
    return SampleRequest(**fields)


def test_preview_is_the_linear_projection_of_the_middle_frame():
    latents = torch.randn(1, 16, 5, 6, 8, generator=torch.Generator().manual_seed(0))
    image = preview_image(latents)
    assert image.shape == (6, 8, 3) and image.dtype == np.uint8
    expected = torch.zeros(6, 8, 3)
    for channel in range(16):  # written as a loop over channels, unlike the einsum it checks
        expected += latents[0, channel, 2][..., None] * WAN21_LATENT_RGB[channel]
    expected = (((expected + WAN21_LATENT_RGB_BIAS) + 1) / 2).clamp(0, 1) * 255
    assert np.abs(image.astype(np.float32) - expected.numpy()).max() <= 0.5 + 1e-3


def test_each_step_reports_a_preview_that_changes_and_sampling_is_unchanged(tiny_models):
    model = load_transformer(str(tiny_models["t2v"]))
    sent: list[dict] = []
    reporter = StepReporter(sent.append)
    with_previews = sample(model, _request(), progress=reporter, preview=reporter.attach_preview)
    without = sample(model, _request(preview=False))
    assert torch.equal(with_previews, without), "previews must not change the result"
    assert [m["step"] for m in sent] == [1, 2, 3, 4] and all("preview" in m for m in sent)
    images = [m["preview"] for m in sent]
    assert all(image.shape == (SHAPE[3], SHAPE[4], 3) for image in images)
    changes = [np.abs(a.astype(int) - b.astype(int)).mean() for a, b in zip(images, images[1:])]
    assert all(change > 0 for change in changes), changes


def test_other_ranks_report_nothing():
    reporter = StepReporter(None)
    reporter.attach_preview(np.zeros((2, 2, 3), np.uint8))
    reporter(1, 2)  # no send function: nothing happens, nothing raises
