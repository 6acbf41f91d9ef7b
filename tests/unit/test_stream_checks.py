"""Streaming options: chunks, schedules and the combinations refused with one-line errors before any work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wanmesh.parallel.config import ParallelConfig, check_stream_layout, check_stream_options, stream_chunks
from wanmesh.parallel.sampling.stream import renoise_seed, sample_stream, stream_sigmas


def test_chunks_cover_the_frames_with_a_shorter_last_one():
    assert stream_chunks(8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert stream_chunks(4, 1) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert stream_chunks(5, 9) == [(0, 5)]


def test_native_schedule_and_explicit_timesteps():
    assert stream_sigmas(4, 5.0) == pytest.approx([1.0, 0.9375, 0.8333333, 0.625, 0.0])
    # Self-Forcing's denoising_step_list, warped by the shift, is the same schedule
    assert stream_sigmas(99, 5.0, [1000, 750, 500, 250]) == pytest.approx(stream_sigmas(4, 5.0))
    assert stream_sigmas(2, 1.0, [1000, 500]) == pytest.approx([1.0, 0.5, 0.0])
    assert stream_sigmas(3, 1.0) == pytest.approx([1.0, 0.667, 0.334, 0.0])  # ComfyUI's "simple" index rounding
    assert renoise_seed(7, 2, 1) == 2008


@pytest.mark.parametrize("args,message", [
    ((8, 0, None, 0), "chunk must be a whole number of latent frames >= 1, got 0"),
    ((8, 3, 2, 0), "kv_window=2 latent frames is smaller than a chunk of 3"),
    ((8, 3, 6, 7), "sink=7 is larger than kv_window=6"),
    ((8, 3, 6, 4), "sink=4 plus a chunk of 3 exceed kv_window=6"),
    ((8, 3, None, -1), "sink must be a whole number of latent frames >= 0, got -1"),
    ((0, 3, None, 0), "the latent must have at least 1 frame, got 0"),
    ((8, 3, None, 0, True), "reanchor moves the pinned sink frames of a rolling window, but kv_window=None"),
    ((8, 3, 6, 0, True), "but kv_window=6 and sink=0; valid: a kv_window and a sink of 1 or more"),
    ((8, 3, 6, 1, True, False), "the uncached reference .* has none: turn one of them off"),
])
def test_bad_options_give_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message) as error:
        check_stream_options(*args)
    assert "\n" not in str(error.value)


def test_layouts_streaming_refuses():
    with pytest.raises(ValueError, match="ring=2: ring attention with a KV cache is not supported"):
        check_stream_layout(ring=2, cfg_parallel=False)
    with pytest.raises(ValueError, match="cfg_parallel"):
        check_stream_layout(ring=1, cfg_parallel=True)
    check_stream_layout(ring=1, cfg_parallel=False)


class _Untouchable:
    """A model that fails the test if sampling gets as far as using it."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was used ({name}) before the inputs were checked")


def _plan(**layout):
    config = ParallelConfig(world=layout.pop("world", 2), **layout)
    return SimpleNamespace(config=config, size=lambda dim: dict(zip(("dp", "cfg", "ulysses", "ring", "tp"),
                                                                    config.mesh_shape))[dim], is_distributed=True)


@pytest.mark.parametrize("options,message", [
    (dict(chunk=0), "chunk must be"),
    (dict(kv_window=1), "smaller than a chunk"),
    (dict(kv_window=4, sink=5), "larger than kv_window"),
    (dict(kv_window=4, sink=1, reanchor=True, use_cache=False), "reanchor turns the keys held in the KV cache"),
    (dict(sigmas=[1.0, 0.5]), "end with 0"),
    (dict(guidance_scale=3.0), "needs a negative context"),
    (dict(plan=_plan(ring=2)), "ring attention with a KV cache"),
    (dict(plan=_plan(cfg_parallel=True)), "cfg_parallel"),
])
def test_sample_stream_rejects_before_any_model_work(options, message):
    arguments = dict(positive=torch.zeros(1, 512, 64), negative=None, latent_shape=(1, 16, 8, 4, 4), seed=0,
                     sigmas=stream_sigmas(4, 5.0), chunk=3)
    with pytest.raises(ValueError, match=message):
        sample_stream(_Untouchable(), **{**arguments, **options})


def test_bad_timestep_lists_are_refused():
    for timesteps in ([], [500, 750], [1200], [0]):
        with pytest.raises(ValueError, match="timesteps must be a non-empty, strictly descending list of values in"):
            stream_sigmas(4, 5.0, timesteps)


def test_a_step_that_predicts_nan_stops_the_chunk_naming_the_step():
    from wanmesh.parallel.sampling.stream import _denoise_step

    sigmas = stream_sigmas(4, 5.0)
    x = torch.zeros(1, 16, 3, 4, 4)
    finite = _denoise_step(lambda latents, sigma: torch.ones_like(latents), x, sigmas, 1, noise_seed=0)
    assert finite.isfinite().all()
    with pytest.raises(FloatingPointError, match="NaN or Inf after step 2 of 4"):
        _denoise_step(lambda latents, sigma: torch.full_like(latents, float("nan")), x, sigmas, 1, noise_seed=0)
