"""Causal streaming on one device, with the tiny T2V model: the KV cache equals recomputation, the causal RoPE is
the whole video's table cut to each chunk, re-anchoring turns the sink as roping it later would, and the
sampling scheme equals an independent hand-written loop.

References used: ``use_cache=False`` (every earlier frame recomputed under a block-causal frame mask, no cache
code at all); the ordinary bidirectional diffusers forward; the native scheme written out in this file with the
plain model (noise from the seed, x0 = x - sigma * v, re-noise seeded with seed + 1000 * chunk + step); RoPE
frequencies computed here from Wan's formula.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from wanmesh.parallel.errors import Cancelled
from wanmesh.parallel.networks.causal import CacheWindow, CausalRope, CausalWan
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, randomise_
from wanmesh.parallel.sampling.latents import denormalize_latents, seeded_noise
from wanmesh.parallel.sampling.stream import sample_stream, stream_sigmas

TOLERANCE = 2e-5
SHAPE = (1, 16, 8, 4, 6)  # 8 latent frames of 2 x 3 tokens: chunks of 3 run as 3 + 3 + 2
SIGMAS = stream_sigmas(4, 5.0)


def _stream(causal_model, text_contexts, **options):
    positive, negative = text_contexts
    arguments = dict(positive=positive, negative=negative, latent_shape=SHAPE, seed=3, sigmas=SIGMAS, chunk=3)
    return sample_stream(causal_model, **{**arguments, **options})


@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_equals_uncached(causal_model, text_contexts, chunk):
    cached = _stream(causal_model, text_contexts, chunk=chunk)
    uncached = _stream(causal_model, text_contexts, chunk=chunk, use_cache=False)
    assert torch.allclose(cached, uncached, atol=TOLERANCE), (cached - uncached).abs().max()
    # causality matters: a chunk size of all frames (bidirectional) gives another video
    assert (cached - _stream(causal_model, text_contexts, chunk=SHAPE[2])).abs().max() > 1e-2


def test_rolling_window_with_sink_equals_uncached_with_the_same_window(causal_model, text_contexts):
    options = dict(chunk=2, kv_window=5, sink=1)
    cached = _stream(causal_model, text_contexts, **options)
    uncached = _stream(causal_model, text_contexts, use_cache=False, **options)
    assert torch.allclose(cached, uncached, atol=TOLERANCE), (cached - uncached).abs().max()
    # the window changes what is seen
    assert (cached - _stream(causal_model, text_contexts, chunk=2)).abs().max() > 1e-3


def test_guidance_keeps_one_cache_per_branch(causal_model, text_contexts):
    cached = _stream(causal_model, text_contexts, guidance_scale=3.0)
    uncached = _stream(causal_model, text_contexts, guidance_scale=3.0, use_cache=False)
    assert torch.allclose(cached, uncached, atol=TOLERANCE), (cached - uncached).abs().max()
    assert (cached - _stream(causal_model, text_contexts)).abs().max() > 1e-3


def test_one_chunk_without_cache_is_the_bidirectional_model(causal_model, text_contexts):
    latents = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    expected = causal_model(hidden_states=latents, timestep=torch.tensor([937.5]),
                            encoder_hidden_states=text_contexts[0], return_dict=False)[0]
    for use_cache in (False, True):
        with CausalWan(causal_model, SHAPE, SHAPE[2], use_cache=use_cache) as causal:
            got = causal.predict(latents, 0, 937.5, text_contexts[0])
        assert torch.allclose(got, expected, atol=TOLERANCE), (got - expected).abs().max()


def test_scheme_equals_a_hand_written_native_loop(causal_model, text_contexts):
    """One chunk of all frames: the stream sampler equals the native scheme written out with the plain model."""
    positive = text_contexts[0]
    x = seeded_noise(SHAPE, 3)
    for step in range(4):
        sigma, following = SIGMAS[step], SIGMAS[step + 1]
        v = causal_model(hidden_states=x, timestep=torch.tensor([1000.0 * sigma]), encoder_hidden_states=positive,
                  return_dict=False)[0]
        x0 = x - sigma * v
        if following > 0:
            eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3 + 1000 * 0 + step))
            x0 = (1 - following) * x0 + following * eps
        x = x0
    got = _stream(causal_model, text_contexts, chunk=SHAPE[2], use_cache=False)
    assert torch.allclose(got, denormalize_latents(x), atol=TOLERANCE), (got - denormalize_latents(x)).abs().max()


def _wan_rope_reference(frames: range, height: int, width: int, head_dim: int, theta: float = 10000.0):
    """Wan's 3-axis RoPE computed from the formula: angle = position * theta^(-2i/d) per axis, interleaved pairs."""
    h_dim = w_dim = 2 * (head_dim // 6)
    t_dim = head_dim - h_dim - w_dim
    grid = torch.stack(torch.meshgrid(torch.tensor(list(frames)), torch.arange(height), torch.arange(width),
                                      indexing="ij"), dim=-1).reshape(-1, 3).double()
    angles = []
    for axis, dim in enumerate((t_dim, h_dim, w_dim)):
        inverse = theta ** (-torch.arange(0, dim, 2).double() / dim)
        angles.append((grid[:, axis : axis + 1] * inverse).repeat_interleave(2, dim=1))
    angle = torch.cat(angles, dim=1)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("start,count", [(0, 3), (5, 3), (6, 2)])
def test_causal_rope_at_start_frame_is_the_whole_video_table_sliced(causal_model, start, count):
    rope = CausalRope(causal_model, SHAPE[2], SHAPE[3], SHAPE[4])
    cos, sin = rope.frames(start, count)
    ref_cos, ref_sin = _wan_rope_reference(range(start, start + count), SHAPE[3] // 2, SHAPE[4] // 2,
                                           TINY_TRANSFORMER["attention_head_dim"])
    assert torch.allclose(cos[0, :, 0].double(), ref_cos, atol=1e-6)
    assert torch.allclose(sin[0, :, 0].double(), ref_sin, atol=1e-6)
    # exactly the rows of diffusers' own RoPE over the whole video, cut to the chunk
    whole_cos, whole_sin = type(causal_model.rope).forward(causal_model.rope, torch.empty(1, 1, *SHAPE[2:], device="meta"))
    rows = slice(start * 6, (start + count) * 6)
    assert torch.equal(cos, whole_cos[:, rows]) and torch.equal(sin, whole_sin[:, rows])


@pytest.mark.parametrize("frame,shift", [(0, 1), (1, 5), (2, 3)])
def test_turning_roped_keys_later_in_time_equals_roping_them_there(causal_model, frame, shift):
    """Re-anchoring's rotation: keys roped at ``frame`` and turned ``shift`` frames later equal the same keys
    roped at ``frame + shift`` (height and width positions untouched)."""
    from wanmesh.parallel.distributed.context_parallel import apply_wan_rotary

    rope = CausalRope(causal_model, SHAPE[2], SHAPE[3], SHAPE[4])
    keys = torch.randn(1, 2 * 6, 2, TINY_TRANSFORMER["attention_head_dim"], generator=torch.Generator().manual_seed(4))
    turned = apply_wan_rotary(apply_wan_rotary(keys, *rope.frames(frame, 2)), *rope.time_shift(shift, 2))
    there = apply_wan_rotary(keys, *rope.frames(frame + shift, 2))
    assert torch.allclose(turned, there, atol=1e-6), (turned - there).abs().max()
    assert (turned - apply_wan_rotary(keys, *rope.frames(frame, 2))).abs().max() > 1e-3


def test_reanchoring_changes_nothing_until_the_window_rolls_then_moves_only_the_sink(causal_model, text_contexts):
    """kv_window 5, sink 1, chunks of 2 over 8 frames: the window first drops a frame for the chunk ending at 6,
    so chunks 0 and 1 are the plain window's exactly; later chunks differ (the sink now sits right before the
    oldest recent frame), and the KV cache holds one copy of the sink's keys more."""
    options = dict(chunk=2, kv_window=5, sink=1)
    plain, plain_stats, anchored_stats = {}, {}, {}
    plain = _stream(causal_model, text_contexts, stats=plain_stats, **options)
    anchored = _stream(causal_model, text_contexts, reanchor=True, stats=anchored_stats, **options)
    assert torch.equal(anchored[:, :, :4], plain[:, :, :4])
    assert (anchored[:, :, 4:] - plain[:, :, 4:]).abs().max() > 1e-3
    blocks, heads, head_dim = (TINY_TRANSFORMER[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim"))
    sink_keys = blocks * 6 * heads * head_dim * 4  # one frame of keys per block, fp32
    assert anchored_stats["cache_bytes"] == plain_stats["cache_bytes"] + sink_keys


def test_short_last_chunk_callbacks_and_progress(causal_model, text_contexts):
    seen, progress = [], []
    result = _stream(causal_model, text_contexts, on_chunk=lambda i, s, x: seen.append((i, s, x)),
                     progress=lambda done, total: progress.append((done, total)))
    assert [(i, s, x.shape[2]) for i, s, x in seen] == [(0, 0, 3), (1, 3, 3), (2, 6, 2)]
    assert torch.equal(torch.cat([x for _, _, x in seen], dim=2), result)
    assert progress == [(n, 12) for n in range(1, 13)]


def test_cancel_between_steps(causal_model, text_contexts):
    calls = []
    with pytest.raises(Cancelled, match="step 2 of chunk 1"):
        _stream(causal_model, text_contexts, should_stop=lambda: calls.append(1) or len(calls) > 1)


def test_stats_report_chunk_times_and_a_cache_bounded_by_the_window(causal_model, text_contexts):
    whole, windowed = {}, {}
    _stream(causal_model, text_contexts, chunk=2, stats=whole)
    _stream(causal_model, text_contexts, chunk=2, kv_window=4, sink=1, stats=windowed)
    blocks, heads, head_dim = (TINY_TRANSFORMER[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim"))
    frame_bytes = 2 * blocks * 6 * heads * head_dim * 4  # keys and values of one latent frame (6 tokens), fp32
    assert whole["cache_bytes"] == 8 * frame_bytes and windowed["cache_bytes"] == 4 * frame_bytes
    assert len(whole["chunk_seconds"]) == 4 and whole["chunk_seconds"] == sorted(whole["chunk_seconds"])


def test_window_bounds_the_cache_and_restores_the_model(causal_model, text_contexts):
    own_processor, own_rope = causal_model.blocks[0].attn1.processor, causal_model.rope
    with CausalWan(causal_model, SHAPE, 2, CacheWindow(kv_window=4, sink=1)) as causal:
        latents = torch.randn(SHAPE)
        for start in range(0, SHAPE[2], 2):
            causal.predict(latents[:, :, start : start + 2], start, 500.0, text_contexts[0])
            causal.write(latents[:, :, start : start + 2], start, text_contexts[0])
        kept = [cache.frame_ids for cache in causal.caches["positive"]]
    assert kept == [[0, 5, 6, 7]] * len(causal_model.blocks)  # sink frame 0 pinned, then the 3 most recent frames
    assert causal_model.blocks[0].attn1.processor is own_processor and causal_model.rope is own_rope


def test_odd_latent_size_streams_with_the_cache_as_without():
    """A latent of odd height and width: the loaded model pads it to its patches (as native Wan) and the causal RoPE
    and frame masks cover the padded grid, so the cache still equals recomputation and the shape comes back."""
    from wanmesh.parallel.networks.wan_inputs import pad_inputs_to_patches

    torch.manual_seed(0)
    t2v = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(t2v, 11)
    padded = pad_inputs_to_patches(t2v.eval().requires_grad_(False))
    generator = torch.Generator().manual_seed(5)
    positive = torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=generator)
    options = dict(positive=positive, negative=None, latent_shape=(1, 16, 4, 5, 7), seed=3, sigmas=SIGMAS, chunk=2)
    cached = sample_stream(padded, **options)
    uncached = sample_stream(padded, use_cache=False, **options)
    assert cached.shape == (1, 16, 4, 5, 7)
    assert torch.allclose(cached, uncached, atol=TOLERANCE), (cached - uncached).abs().max()
