"""GGUF dequantisation in torch (``parallel/weights/dequant.py``) against the gguf package's numpy dequantiser,
and the test-file K-type quantisers (``parallel/tiny/gguf_write.py``) against the values they were given.

Every supported type is bit-exact in float32 (the products are of an f16 scale and small integers, so exact;
the one rounding, taking off a min, is the subtraction gguf makes), so the comparisons are of the bits, zeros'
signs included.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from wanmesh.parallel.weights.dequant import SUPPORTED_TYPES, dequantize
from wanmesh.parallel.tiny.gguf_write import quantize

Q = gguf.GGMLQuantizationType
ROWS, COLUMNS = 6, 512  # two 256-element K blocks per row, so half a row is still whole blocks
TYPES = sorted(SUPPORTED_TYPES, key=lambda qtype: qtype.name)
# Bars on the relative RMS error of a row's round trip through each K quantiser: the plain fits give
# 0.017-0.020, 0.036-0.043, 0.073-0.087, 0.144-0.162 and 0.31-0.36 on these weights, while a wrongly packed
# field throws values off by far more.
K_ROUND_TRIP_ERROR = {Q.Q6_K: 0.025, Q.Q5_K: 0.05, Q.Q4_K: 0.1, Q.Q3_K: 0.2, Q.Q2_K: 0.4}


def weights(seed: int = 0) -> np.ndarray:
    """Weight-like values: Gaussian at a typical linear layer's scale, with one outlier row to spread the
    per-block scales."""
    values = np.random.default_rng(seed).standard_normal((ROWS, COLUMNS)).astype(np.float32) * 0.02
    values[1] *= 30
    return values


def stored_bytes(qtype: Q) -> np.ndarray:
    """`weights()` as stored in a file: uint8 rows of whole blocks (float types come back typed; view them)."""
    stored = np.ascontiguousarray(quantize(weights(), qtype))
    return stored.view(np.uint8)


def gguf_values(data: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(np.ascontiguousarray(data), qtype), dtype=np.float32))


def assert_same_bits(values: torch.Tensor, expected: torch.Tensor) -> None:
    assert values.dtype == expected.dtype and values.shape == expected.shape
    as_integers = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[values.dtype]
    mismatched = values.view(as_integers) != expected.view(as_integers)
    assert not mismatched.any(), f"{int(mismatched.sum())} values differ, first at {mismatched.nonzero()[0].tolist()}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda qtype: qtype.name)
def test_whole_rows_equal_gguf(qtype):
    data = stored_bytes(qtype)
    values = dequantize(torch.from_numpy(data), qtype)
    assert values.dtype == torch.float32 and values.shape == (ROWS, COLUMNS)
    assert_same_bits(values, gguf_values(data, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda qtype: qtype.name)
def test_row_and_column_slices_equal_gguf(qtype):
    data = stored_bytes(qtype)
    assert_same_bits(dequantize(torch.from_numpy(data)[2:5], qtype), gguf_values(data[2:5], qtype))
    # The second half of every row's blocks: a non-contiguous slice, as a row-parallel shard reads.
    half = data.shape[1] // 2
    columns = dequantize(torch.from_numpy(data)[:, half:], qtype)
    assert_same_bits(columns, gguf_values(data[:, half:], qtype))
    assert_same_bits(columns, gguf_values(data, qtype)[:, COLUMNS // 2:])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda qtype: qtype.name)
def test_bfloat16_is_the_float32_result_cast(qtype):
    data = stored_bytes(qtype)
    values = dequantize(torch.from_numpy(data), qtype, dtype=torch.bfloat16)
    assert values.dtype == torch.bfloat16
    assert_same_bits(values, gguf_values(data, qtype).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda qtype: qtype.name)
def test_float_types_come_typed_or_as_bytes(qtype):
    data = stored_bytes(qtype)
    typed = torch.from_numpy(data.copy()).view({Q.F32: torch.float32, Q.F16: torch.float16,
                                                Q.BF16: torch.bfloat16}[qtype])
    assert_same_bits(dequantize(typed, qtype), gguf_values(data, qtype))
    assert_same_bits(dequantize(typed[:, 100:300], qtype), gguf_values(data, qtype)[:, 100:300])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda qtype: qtype.name)
def test_cuda_equals_gguf(qtype):
    data = stored_bytes(qtype)
    values = dequantize(torch.from_numpy(data).cuda()[:, data.shape[1] // 2:], qtype)
    assert values.is_cuda
    assert_same_bits(values.cpu(), gguf_values(data, qtype)[:, COLUMNS // 2:])


def test_leading_dims_are_kept():
    data = stored_bytes(Q.Q4_K)
    stacked = torch.from_numpy(data).reshape(2, 3, -1)
    assert_same_bits(dequantize(stacked, Q.Q4_K), gguf_values(data, Q.Q4_K).reshape(2, 3, -1))


@pytest.mark.parametrize("qtype", list(K_ROUND_TRIP_ERROR), ids=lambda qtype: qtype.name)
def test_k_quantisers_read_back_close_to_their_input(qtype):
    original = weights(seed=1)
    stored = quantize(original, qtype)
    assert stored.dtype == np.uint8
    assert stored.shape == (ROWS, COLUMNS // gguf.QK_K * gguf.GGML_QUANT_SIZES[qtype][1])
    read_back = gguf.quants.dequantize(stored, qtype)
    for row in range(ROWS):  # per row, so the outlier row does not hide the others' error
        error = np.linalg.norm(read_back[row] - original[row]) / np.linalg.norm(original[row])
        assert error < K_ROUND_TRIP_ERROR[qtype], f"{qtype.name} row {row}: relative error {error:.3f}"


@pytest.mark.parametrize("qtype", list(K_ROUND_TRIP_ERROR), ids=lambda qtype: qtype.name)
def test_k_quantisers_keep_zero_blocks_and_signs(qtype):
    original = weights(seed=2)
    original[0, :256] = 0.0  # an all-zero block has zero scales: no division by zero, reads back as zeros
    original[3] = np.abs(original[3])  # one-signed rows exercise the min / the signed scale
    original[4] = -np.abs(original[4])
    read_back = gguf.quants.dequantize(quantize(original, qtype), qtype)
    assert np.isfinite(read_back).all()
    np.testing.assert_array_equal(read_back[0, :256], 0.0)
    for row in (3, 4):
        error = np.linalg.norm(read_back[row] - original[row]) / np.linalg.norm(original[row])
        assert error < K_ROUND_TRIP_ERROR[qtype], f"{qtype.name} row {row}: relative error {error:.3f}"


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.TQ2_0], ids=lambda qtype: qtype.name)
def test_unsupported_type_is_named(qtype):
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    with pytest.raises(ValueError, match=rf"{qtype.name}.*supported: .*Q4_K"):
        dequantize(torch.zeros(2, block_bytes, dtype=torch.uint8), qtype)


def test_partial_block_is_refused():
    with pytest.raises(ValueError, match="Q4_K.*144-byte blocks"):
        dequantize(torch.zeros(2, 200, dtype=torch.uint8), Q.Q4_K)
