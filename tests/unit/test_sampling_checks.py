"""Sampling settings refused before any work (NaN or negative guidance, non-finite shift), and a run whose
latents turn NaN or Inf stopped at the step that did it instead of decoding black frames."""

from __future__ import annotations

import math

import pytest
import torch

from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample


def _request(**overrides) -> SampleRequest:
    fields = dict(handle="model|x", latent=torch.zeros(latent_shape(32, 32, 5)), positive=[torch.zeros(4, 8)],
                  negative=[torch.zeros(4, 8)], seed=1, steps=3, guidance_scale=5.0, shift=3.0, sampler="euler")
    fields.update(overrides)
    return SampleRequest(**fields)


@pytest.mark.parametrize("field, value, message", [
    ("guidance_scale", math.nan, r"guidance scale \(cfg\) must be a finite number >= 0, got nan"),
    ("guidance_scale", -1.0, r"guidance scale \(cfg\) must be a finite number >= 0, got -1.0"),
    ("guidance_scale", math.inf, "got inf"),
    ("shift", math.nan, "shift must be a positive finite number, got nan"),
])
def test_bad_sampling_settings_are_refused_by_the_driver_check(field, value, message):
    with pytest.raises(ValueError, match=message):
        _request(**{field: value}).validate()


def _model_turning_nan_at(call: int):
    calls = []

    def model(hidden_states, **kwargs):
        calls.append(1)
        value = math.nan if len(calls) >= call else 0.1
        return (torch.full_like(hidden_states, value),)

    return model


def test_non_finite_latents_stop_the_run_naming_the_step():
    # Two passes per step with guidance: the 3rd call is the first pass of step 2.
    with pytest.raises(FloatingPointError, match="NaN or Inf after step 2 of 3"):
        sample(_model_turning_nan_at(3), _request())
    assert sample(_model_turning_nan_at(99), _request()).isfinite().all()
