"""Causal streaming from a start image (as ComfyUI's ARVideoI2V seeds its KV cache), one device, tiny T2V model: the
start latent is kept as given, its cache write equals recomputing it under the frame mask (``use_cache=False``, no
cache code), with guidance and a rolling window too, and it changes what is generated after it; chunk indices,
progress and bad start latents."""

from __future__ import annotations

import pytest
import torch

from wanmesh.parallel.config import stream_chunks
from wanmesh.parallel.protocol import StreamSample
from wanmesh.parallel.sampling.stream import sample_stream, stream_sigmas

TOLERANCE = 2e-5
SHAPE = (1, 16, 8, 4, 6)  # 8 latent frames: the start frame, then chunks of 3 as 3 + 3 + 1
SIGMAS = stream_sigmas(4, 5.0)


def _start(seed: int = 7, shape=SHAPE) -> torch.Tensor:
    return torch.randn(1, 16, 1, *shape[3:], generator=torch.Generator().manual_seed(seed)) * 2


def _stream(causal_model, text_contexts, **options):
    positive, negative = text_contexts
    arguments = dict(positive=positive, negative=negative, latent_shape=SHAPE, seed=3, sigmas=SIGMAS, chunk=3,
                     start_latent=_start())
    return sample_stream(causal_model, **{**arguments, **options})


@pytest.mark.parametrize("options", [{}, {"guidance_scale": 3.0}, {"chunk": 2, "kv_window": 5, "sink": 1}],
                         ids=["plain", "guidance", "window"])
def test_start_frame_is_kept_and_its_cache_equals_recomputation(causal_model, text_contexts, options):
    cached = _stream(causal_model, text_contexts, **options)
    uncached = _stream(causal_model, text_contexts, use_cache=False, **options)
    assert torch.equal(cached[:, :, :1], _start())
    assert torch.allclose(cached, uncached, atol=TOLERANCE), (cached - uncached).abs().max()


def test_the_start_image_changes_what_follows(causal_model, text_contexts):
    one, other = _stream(causal_model, text_contexts), _stream(causal_model, text_contexts, start_latent=_start(8))
    assert (one[:, :, 1:] - other[:, :, 1:]).abs().max() > 1e-3
    plain = sample_stream(causal_model, positive=text_contexts[0], negative=None, latent_shape=SHAPE, seed=3,
                          sigmas=SIGMAS, chunk=3)
    assert (one[:, :, 1:] - plain[:, :, 1:]).abs().max() > 1e-3


def test_chunks_callbacks_and_progress_count_the_start_frame_as_chunk_zero(causal_model, text_contexts):
    seen, progress = [], []
    result = _stream(causal_model, text_contexts, on_chunk=lambda i, s, x: seen.append((i, s, x)),
                     progress=lambda done, total: progress.append((done, total)))
    assert [(i, s, x.shape[2]) for i, s, x in seen] == [(0, 0, 1), (1, 1, 3), (2, 4, 3), (3, 7, 1)]
    assert torch.equal(seen[0][2], _start()) and torch.equal(torch.cat([x for *_, x in seen], dim=2), result)
    assert progress == [(n, 12) for n in range(1, 13)]  # only generated chunks take steps
    assert stream_chunks(8, 3, 1) == [(0, 1), (1, 3), (4, 3), (7, 1)]


def test_a_batch_takes_one_start_latent_for_every_row(causal_model, text_contexts):
    shape = (2, *SHAPE[1:])
    positive = text_contexts[0].expand(2, -1, -1)
    got = sample_stream(causal_model, positive=positive, negative=None, latent_shape=shape, seed=3, sigmas=SIGMAS,
                        chunk=3, start_latent=_start())
    assert torch.equal(got[:, :, :1], _start().expand(2, -1, -1, -1, -1))


@pytest.mark.parametrize("start, options, message", [
    (torch.zeros(1, 16, 1, 4, 8), {}, "the start latent must be"),
    (torch.zeros(1, 48, 1, 4, 6), {}, "the start latent must be"),
    (torch.zeros(1, 16, 8, 4, 6), {}, "nothing is left to generate"),
    (torch.zeros(1, 16, 2, 4, 6), {"chunk": 1, "kv_window": 2, "sink": 1}, "do not fit kv_window=2"),
])
def test_bad_start_latents_are_one_line_errors(start, options, message):
    request = StreamSample(handle="m", latent=torch.zeros(SHAPE), positive=[torch.zeros(1, 4, 8)], negative=[],
                           seed=0, start_latent=start, **options)
    with pytest.raises(ValueError, match=message) as error:
        request.validate()
    assert "\n" not in str(error.value)
