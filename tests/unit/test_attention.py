"""Unit tests of the local attention seam and of the log-sum-exp block merge (no processes)."""

import pytest
import torch
import torch.nn.functional as F

from wanmesh.parallel.distributed.attention import BACKENDS, _LseMerger, attention, select_backend


def _random_qkv(batch, q_len, kv_len, heads, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, q_len, heads, dim), (batch, kv_len, heads, dim), (batch, kv_len, heads, dim))
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def _reference(q, k, v, key_padding):
    """float64 output and lse from PyTorch's SDPA with an explicit boolean key mask."""
    q64, k64, v64 = (x.double().transpose(1, 2) for x in (q, k, v))
    kv_len = k.shape[1]
    keep = (torch.arange(kv_len) < kv_len - key_padding).expand(q.shape[1], kv_len)
    out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=keep)
    scores = (q64 @ k64.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)
    return out.transpose(1, 2), lse


CASES = [
    # batch, q_len, kv_len, heads, dim, key_padding
    (1, 7, 7, 2, 8, 0),
    (2, 5, 9, 3, 16, 4),
    (1, 16, 13, 4, 32, 12),
    (2, 1, 3, 1, 8, 1),
]


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_float64_reference(backend, dtype, tolerance, case):
    batch, q_len, kv_len, heads, dim, key_padding = case
    q, k, v = _random_qkv(batch, q_len, kv_len, heads, dim, dtype, seed=sum(case))
    out, lse = attention(q, k, v, key_padding=key_padding, return_lse=True, backend=backend)
    expected_out, expected_lse = _reference(q, k, v, key_padding)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (batch, heads, q_len)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (out.double() - expected_out).abs().max() <= tolerance
    assert (lse.double() - expected_lse).abs().max() <= tolerance


def test_padding_keys_get_no_weight():
    q, k, v = _random_qkv(1, 4, 6, 2, 8, torch.float32, seed=3)
    garbage_k, garbage_v = k.clone(), v.clone()
    garbage_k[:, 4:] = 1e4
    garbage_v[:, 4:] = float("nan")
    torch.testing.assert_close(attention(q, garbage_k, garbage_v, key_padding=2), attention(q, k[:, :4], v[:, :4]))


def test_bfloat16_returns_float32_lse():
    q, k, v = _random_qkv(1, 8, 8, 2, 16, torch.bfloat16, seed=5)
    out, lse = attention(q, k, v, return_lse=True)
    expected_out, expected_lse = _reference(q, k, v, 0)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (out.double() - expected_out).abs().max() < 3e-2
    assert (lse.double() - expected_lse).abs().max() < 1e-3


def test_explicit_scale():
    q, k, v = _random_qkv(1, 5, 5, 2, 8, torch.float64, seed=7)
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.3).transpose(1, 2)
    torch.testing.assert_close(attention(q, k, v, scale=0.3), expected)


@pytest.mark.parametrize("split", [[5], [2, 3], [1, 1, 3], [4, 1]])
def test_lse_merge_of_key_blocks_equals_full_attention(split):
    q, k, v = _random_qkv(2, 6, 5, 3, 8, torch.float64, seed=len(split))
    merger = _LseMerger()
    for k_block, v_block in zip(k.split(split, dim=1), v.split(split, dim=1)):
        merger.add(*attention(q, k_block, v_block, return_lse=True))
    expected, expected_lse = _reference(q, k, v, 0)
    assert (merger.result(torch.float64) - expected).abs().max() <= 1e-10
    assert (merger.lse - expected_lse).abs().max() <= 1e-10


def test_cpu_default_backend_and_names():
    assert select_backend(torch.zeros(1, 1, 1, 8)) == "cpu_flash"
    assert set(BACKENDS) >= {"cpu_flash", "flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math"}


@pytest.mark.parametrize(
    "kwargs,shapes,message",
    [
        ({"key_padding": 6}, ((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "key_padding must be in"),
        ({"key_padding": -1}, ((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "key_padding must be in"),
        ({"backend": "bogus"}, ((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "valid: cpu_flash"),
        ({}, ((1, 4, 2, 8), (1, 6, 2, 8), (1, 5, 2, 8)), "k and v must have the same shape"),
        ({}, ((1, 4, 3, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "q and k must agree"),
        ({}, ((4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), r"\[batch, seq, heads, head_dim\]"),
    ],
)
def test_bad_input_is_rejected(kwargs, shapes, message):
    q, k, v = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **kwargs)
