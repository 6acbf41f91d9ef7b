"""VACE through the sampler: native conditioning lists, several contexts, the native default context, the
text used as given, and the checks made before sampling. The single-context path is diffusers' own forward;
the several-context path is compared with it."""

from __future__ import annotations

import pytest
import torch

from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import pad_to_wan_text_length, sample

SHAPE = latent_shape(64, 48, 5)


@pytest.fixture(scope="module")
def vace(tiny_models):
    return load_transformer(str(tiny_models["vace"]))


def _context(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 32, *SHAPE[2:], generator=generator),
            torch.rand(1, 64, *SHAPE[2:], generator=generator).round())


def _request(text_dim: int, contexts=(), strengths=(), **overrides) -> SampleRequest:
    generator = torch.Generator().manual_seed(3)
    fields = dict(handle="model|unused", latent=torch.zeros(SHAPE), seed=5, steps=3, guidance_scale=4.0, shift=3.0,
                  positive=[pad_to_wan_text_length(torch.randn(6, text_dim, generator=generator))],
                  negative=[pad_to_wan_text_length(torch.randn(3, text_dim, generator=generator))],
                  vace_frames=[c[0] for c in contexts], vace_masks=[c[1] for c in contexts],
                  vace_strengths=list(strengths))
    fields.update(overrides)
    request = SampleRequest(**fields)
    request.validate()
    return request


def _forward(model, contexts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    latents = torch.randn(SHAPE, generator=generator)
    text = torch.randn(1, 8, model.config.text_dim, generator=generator)
    return model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                 control_hidden_states=contexts, control_hidden_states_scale=scale, return_dict=False)[0]


def test_several_context_forward_agrees_with_diffusers_single_context_forward(vace):
    generator = torch.Generator().manual_seed(1)
    first, second = (torch.randn(1, 96, *SHAPE[2:], generator=generator) for _ in range(2))
    layers = len(vace.config.vace_layers)
    with torch.no_grad():
        diffusers_one = _forward(vace, first, torch.full((layers,), 0.7))  # diffusers' own forward
        ours_one = vace._forward_contexts(  # the several-context code path, given one context
            *_forward_inputs(vace), first.unsqueeze(1), torch.tensor([0.7]))
        pair_with_zero = _forward(vace, torch.stack([first, second], 1), torch.tensor([0.7, 0.0]))
        pair = _forward(vace, torch.stack([first, second], 1), torch.tensor([0.7, 0.5]))
    torch.testing.assert_close(ours_one, diffusers_one, rtol=0, atol=1e-5)
    torch.testing.assert_close(pair_with_zero, diffusers_one, rtol=0, atol=1e-5)
    assert (pair - diffusers_one).abs().max() > 1e-3, "the second context had no effect"


def _forward_inputs(model):
    generator = torch.Generator().manual_seed(11)
    latents = torch.randn(SHAPE, generator=generator)
    text = torch.randn(1, 8, model.config.text_dim, generator=generator)
    return latents, torch.tensor([500.0]), text, None


def test_two_contexts_at_zero_strength_equal_no_hints_and_each_context_counts(tiny_models, vace):
    t2v = load_transformer(str(tiny_models["t2v"]))
    dim = vace.config.text_dim
    contexts = (_context(1), _context(2))
    plain = sample(t2v, _request(dim))
    off = sample(vace, _request(dim, contexts, (0.0, 0.0)))
    both = sample(vace, _request(dim, contexts, (1.0, 0.6)))
    first_only = sample(vace, _request(dim, contexts[:1], (1.0,)))
    torch.testing.assert_close(off, plain, rtol=0, atol=1e-5)
    assert (both - first_only).abs().max() > 1e-3


def test_no_vace_conditioning_runs_the_native_default_context(vace):
    dim = vace.config.text_dim
    default = sample(vace, _request(dim))
    explicit = sample(vace, _request(dim, [(torch.zeros(1, 32, *SHAPE[2:]), torch.ones(1, 64, *SHAPE[2:]))], (1.0,)))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def test_conditioning_text_is_used_as_given(vace):
    """Native conditioning is not padded to 512 tokens: a short prompt tensor gives another result."""
    short = torch.randn(6, vace.config.text_dim, generator=torch.Generator().manual_seed(4))
    as_given = sample(vace, _request(vace.config.text_dim, positive=[short], guidance_scale=1.0))
    padded = sample(vace, _request(vace.config.text_dim, positive=[pad_to_wan_text_length(short)], guidance_scale=1.0))
    assert (as_given - padded).abs().max() > 1e-4


@pytest.mark.parametrize("fields, message", [
    ({"vace_frames": [torch.zeros(1, 32, 3, 6, 8)], "vace_masks": [torch.ones(1, 64, 3, 6, 8)], "vace_strengths": [1.0]},
     r"vace_frames\[0\] covers latent frames x size \[3, 6, 8\] but the latent is \[2, 6, 8\]"),
    ({"vace_frames": [torch.zeros(1, 16, 2, 6, 8)], "vace_masks": [torch.ones(1, 64, 2, 6, 8)], "vace_strengths": [1.0]},
     r"vace_frames\[0\] has shape \[1, 16, 2, 6, 8\]"),
    ({"vace_frames": [torch.zeros(1, 32, 2, 6, 8)], "vace_masks": [], "vace_strengths": [1.0]},
     "as many masks and strengths as contexts"),
    ({"vace_frames": [torch.zeros(1, 32, 2, 6, 8)], "vace_masks": [torch.ones(1, 64, 2, 6, 8)],
      "vace_strengths": [float("nan")]}, r"vace_strength\[0\] is nan"),
])
def test_vace_conditioning_that_does_not_fit_is_refused_before_sampling(fields, message):
    with pytest.raises(ValueError, match=message):
        _request(8, latent=torch.zeros(latent_shape(64, 48, 5)), **fields)
