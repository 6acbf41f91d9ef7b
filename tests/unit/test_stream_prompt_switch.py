"""Prompt switches in a causal stream, on one device with the tiny T2V model (the ranks' equality: the prompt
switch case of tests/distributed/test_stream_sp.py; the command line and the node: test_stream_cli.py and
tests/comfyui/test_stream_workflow.py).

What a switch must do: the chunks before it are those of the stream without it; from it on the new prompt is
followed; and the frames kept in the cache are re-encoded under the new prompt, not kept as encoded under the old
one. The reference for the last point is the uncached stream (every earlier frame recomputed at every step under
the prompt of the moment): without a window the cached stream with its caches rebuilt equals it, and a stream
whose cache kept the old prompt's keys and values (only the text cross-attention renewed) does not. With a rolling
window the rebuild covers the frames the cache keeps (the sink and the recent window, re-encoded among themselves),
not the history the window already dropped, so it is not the full recompute: there the test checks which chunks
are written again. Bad switches are one line.
"""

from __future__ import annotations

import pytest
import torch

from wanmesh.parallel.networks.causal import CausalWan
from wanmesh.parallel.protocol import StreamSample
from wanmesh.parallel.sampling.stream import sample_stream, stream_sigmas
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER

TOLERANCE = 2e-5
SHAPE = (1, 16, 8, 4, 6)  # 8 latent frames: chunks of 2 run as 2 + 2 + 2 + 2
SIGMAS = stream_sigmas(3, 5.0)


def _prompt(seed: int) -> torch.Tensor:
    return torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(seed))


SWITCHES = {2: _prompt(21), 3: _prompt(22)}


def _stream(model, **options) -> tuple[torch.Tensor, dict]:
    stats: dict = {}
    arguments = dict(positive=_prompt(20), negative=None, latent_shape=SHAPE, seed=3, sigmas=SIGMAS, chunk=2,
                     stats=stats)
    return sample_stream(model, **{**arguments, **options}), stats


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("window", [dict(), dict(kv_window=6, sink=2)], ids=["whole", "window6_sink2"])
def test_a_switch_keeps_the_chunks_before_it_and_rebuilds_the_cache(causal_model, window):
    plain, _ = _stream(causal_model, **window)
    switched, stats = _stream(causal_model, prompt_switches=SWITCHES, **window)
    reference, _ = _stream(causal_model, prompt_switches=SWITCHES, use_cache=False, **window)
    assert _largest(switched[:, :, :4], plain[:, :, :4]) == 0.0, "a chunk before the switch changed"
    assert _largest(switched[:, :, 4:], plain[:, :, 4:]) > 1e-2, "the new prompt changed nothing"
    # the chunks written again at each switch: the earlier chunks the next one still sees (with the window of 6
    # frames and 2 sink frames, chunk 3 (frames 6, 7) sees frames 0, 1 and 4, 5: chunks 0 and 2)
    assert stats["recached_chunks"] == ({2: 2, 3: 3} if not window else {2: 2, 3: 2})
    if not window:
        assert _largest(switched, reference) < TOLERANCE


def test_a_cache_left_under_the_old_prompt_is_another_video(causal_model, monkeypatch):
    reference, _ = _stream(causal_model, prompt_switches=SWITCHES, use_cache=False)

    def renew_only_the_text(self, context, earlier, next_end, branch="positive"):
        for key in [key for key in self.cross_cache if key[0] == branch]:
            del self.cross_cache[key]
        return 0

    monkeypatch.setattr(CausalWan, "recache", renew_only_the_text)
    stale, _ = _stream(causal_model, prompt_switches=SWITCHES)
    assert _largest(stale, reference) > 100 * TOLERANCE


def test_a_switch_with_guidance_keeps_the_negative_branch(causal_model):
    negative = _prompt(30)
    switched, _ = _stream(causal_model, prompt_switches=SWITCHES, negative=negative, guidance_scale=3.0)
    reference, _ = _stream(causal_model, prompt_switches=SWITCHES, negative=negative, guidance_scale=3.0,
                           use_cache=False)
    assert _largest(switched, reference) < TOLERANCE


@pytest.mark.parametrize("chunks, message", [
    ([0], "a prompt switch at chunk 0 is not valid for a stream of 4 chunks of 2 latent frames; valid: 1 to 3"),
    ([4], "a prompt switch at chunk 4 is not valid"),
    ([3, 2], "a prompt switch at chunk 2 is not valid"),
])
def test_a_bad_switch_is_one_line_before_any_work(chunks, message):
    request = StreamSample(handle="h", latent=torch.zeros(SHAPE), positive=[torch.zeros(4, 8)], negative=[],
                           seed=1, chunk=2, switch_chunks=chunks, switch_positive=[[torch.zeros(4, 8)]] * len(chunks))
    with pytest.raises(ValueError) as error:
        request.validate()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_switches_and_prompts_must_pair():
    request = StreamSample(handle="h", latent=torch.zeros(SHAPE), positive=[torch.zeros(4, 8)], negative=[],
                           seed=1, chunk=2, switch_chunks=[1, 2], switch_positive=[[torch.zeros(4, 8)]])
    with pytest.raises(ValueError, match="2 prompt switch chunks but 1 prompts"):
        request.validate()
