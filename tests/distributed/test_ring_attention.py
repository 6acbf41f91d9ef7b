"""Context-parallel attention on spawned gloo ranks: ring, Ulysses and USP against full attention.

Each configuration group runs in one spawned world; every rank builds the same global
sequence from a seed, runs the parallel kernel on its slice and compares with float64
attention over the whole (unpadded) sequence.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from wanmesh.parallel.auto_layout import Layout, block_calls
from wanmesh.parallel.auto_layout import block_bytes as model_block_bytes
from wanmesh.parallel.distributed.attention import ring_attention, ulysses_attention
from wanmesh.parallel.bench.attention import METHODS, _bench_point
from wanmesh.parallel.distributed.collectives import CollectiveCounter
from wanmesh.parallel.distributed.spawn import spawn_ranks

PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=60)
HARD_DEADLINE_S = 180.0
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
BATCH, HEADS, HEAD_DIM = 2, 4, 8


# ------------------------------------------------------------------ spawning


def _rank_entry(rank: int, world: int, check_name: str) -> None:
    globals()[check_name](rank, world)


def _run_world(world: int, check_name: str) -> None:
    spawn_ranks(_rank_entry, world, args=(check_name,), deadline_s=HARD_DEADLINE_S)


# ------------------------------------------------------------------ data and reference


def _global_sequence(valid_len: int, padded_len: int, dtype: torch.dtype, seed: int):
    """q, k, v of `padded_len` positions; positions >= valid_len hold large garbage."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(3):
        x = torch.randn(BATCH, padded_len, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
        x[:, valid_len:] = 50.0
        tensors.append(x)
    reference = F.scaled_dot_product_attention(*(t[:, :valid_len].transpose(1, 2) for t in tensors)).transpose(1, 2)
    return [t.to(dtype) for t in tensors], reference


def _slice(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    return x.chunk(parts, dim=1)[index]


def _compare(label: str, out: torch.Tensor, reference: torch.Tensor, slot: int, parts: int, valid_len: int):
    """Compares this rank's output slice with the reference at the same (valid) global positions."""
    block = out.shape[1]
    start = slot * block
    valid_here = max(min(valid_len - start, block), 0)
    expected = reference[:, start : start + valid_here]
    diff = (out[:, :valid_here].double() - expected).abs().max().item() if valid_here else 0.0
    assert out.shape == (BATCH, block, HEADS, HEAD_DIM), f"{label}: shape {tuple(out.shape)}"
    assert diff <= TOLERANCE[out.dtype], f"{label}: max abs diff {diff:.3g} on rank slot {slot}/{parts}"


def _padded(valid_len: int, parts: int) -> int:
    return -(-valid_len // parts) * parts


# ------------------------------------------------------------------ checks run inside the ranks


def _check_ring(rank: int, world: int, lengths: list[int]) -> None:
    for valid_len in lengths:
        for dtype in (torch.float32, torch.float64):
            (q, k, v), reference = _global_sequence(valid_len, _padded(valid_len, world), dtype, seed=valid_len)
            local = [_slice(t, rank, world) for t in (q, k, v)]
            for overlap in (True, False):
                out = ring_attention(*local, None, valid_kv_len=valid_len, overlap=overlap)
                label = f"ring{world} L={valid_len} {dtype} overlap={overlap}"
                _compare(label, out, reference, rank, world, valid_len)


def check_world_2(rank: int, world: int) -> None:
    _check_ring(rank, world, lengths=[8, 7])
    for valid_len in (8, 5):
        (q, k, v), reference = _global_sequence(valid_len, _padded(valid_len, world), torch.float32, seed=1)
        out = ulysses_attention(*(_slice(t, rank, world) for t in (q, k, v)), None, valid_kv_len=valid_len)
        _compare(f"ulysses2 L={valid_len}", out, reference, rank, world, valid_len)
    _check_traffic(rank, world)
    _check_bench_point(world)
    with pytest.raises(ValueError, match="valid degrees"):
        ulysses_attention(*(torch.zeros(1, 2, 3, 8) for _ in range(3)), None)


def _check_traffic(rank: int, world: int) -> None:
    """Calls and bytes on the wire per rank against the analytic count and the auto layout's cost model."""
    local_len, element = 3, 4
    block_bytes = BATCH * local_len * HEADS * HEAD_DIM * element
    q, k, v = (torch.randn(BATCH, local_len, HEADS, HEAD_DIM) for _ in range(3))
    with CollectiveCounter() as counter:
        ring_attention(q, k, v, None)
    assert counter.calls["isend"] == world - 1 and counter.calls["irecv"] == world - 1, counter.as_dict()
    assert counter.sent["isend"] == (world - 1) * 2 * block_bytes, counter.as_dict()
    assert counter.received["irecv"] == (world - 1) * 2 * block_bytes, counter.as_dict()
    _check_cost_model_counts(Layout(ring=world), counter, local_len, element)
    with CollectiveCounter() as counter:
        ulysses_attention(q, k, v, None)
    assert counter.calls["all_to_all_single"] == 2, counter.as_dict()
    assert counter.sent["all_to_all_single"] == 4 * block_bytes * (world - 1) // world, counter.as_dict()
    _check_cost_model_counts(Layout(ulysses=world), counter, local_len, element)


def _check_cost_model_counts(layout: Layout, counter: CollectiveCounter, local_len: int, element: int) -> None:
    """The auto layout prices one attention's collectives (``block_calls``, ``block_bytes``) as counted."""
    calls, moved = block_calls(layout), model_block_bytes(layout, BATCH * local_len, 0, HEADS * HEAD_DIM, element)
    for kind, op in {"all_to_all": "all_to_all_single", "send_recv": "isend"}.items():
        assert (calls[kind], moved[kind]) == (counter.calls[op], counter.sent[op]), (kind, counter.as_dict())


def _check_bench_point(world: int) -> None:
    """One benchmark point runs each method and its counted traffic equals the analytic count.

    PyTorch's context_parallel is left out: its first call takes minutes of set-up on a small machine.
    """
    methods = [name for name in METHODS if name != "torch_cp"]
    settings = {"batch": 1, "heads": 2, "head_dim": 8, "dtype": "float32", "repeats": 1, "methods": methods}
    rows = _bench_point(settings, 7, torch.device("cpu"))
    assert [row["method"] for row in rows] == methods, rows
    for row in rows:
        assert row["degree"] == world and row["seq_len"] == 7
        if row["sent_bytes"] is not None:
            assert row["time_ms"] > 0 and row["sent_bytes"] == row["analytic_bytes"], row


def check_world_3(rank: int, world: int) -> None:
    # 7 leaves one padding key on the last rank; 4 leaves the last rank's block all padding.
    _check_ring(rank, world, lengths=[9, 7, 4])


def check_world_4(rank: int, world: int) -> None:
    ulysses_degree, ring_degree = 2, 2
    # Every rank creates every group, in the same order, as torch.distributed requires.
    ulysses_groups = [dist.new_group([r * ulysses_degree + u for u in range(ulysses_degree)]) for r in range(ring_degree)]
    ring_groups = [dist.new_group([r * ulysses_degree + u for r in range(ring_degree)]) for u in range(ulysses_degree)]
    ulysses_group, ring_group = ulysses_groups[rank // ulysses_degree], ring_groups[rank % ulysses_degree]
    for valid_len in (16, 13, 9):
        for dtype in (torch.float32, torch.float64):
            (q, k, v), reference = _global_sequence(valid_len, _padded(valid_len, world), dtype, seed=valid_len)
            local = [_slice(t, rank, world) for t in (q, k, v)]
            for overlap in (True, False):
                out = ulysses_attention(*local, ulysses_group, valid_kv_len=valid_len, inner=ring_group, overlap=overlap)
                _compare(f"usp2x2 L={valid_len} {dtype} overlap={overlap}", out, reference, rank, world, valid_len)
            out = ring_attention(*local, None, valid_kv_len=valid_len)
            _compare(f"ring4 L={valid_len} {dtype}", out, reference, rank, world, valid_len)
            out = ulysses_attention(*local, None, valid_kv_len=valid_len)
            _compare(f"ulysses4 L={valid_len} {dtype}", out, reference, rank, world, valid_len)
    q, k, v = (torch.randn(BATCH, 3, HEADS, HEAD_DIM) for _ in range(3))
    with CollectiveCounter() as counter:
        ulysses_attention(q, k, v, ulysses_group, inner=ring_group)
    _check_cost_model_counts(Layout(ulysses=ulysses_degree, ring=ring_degree), counter, 3, 4)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_attention_matches_full_attention(world):
    _run_world(world, f"check_world_{world}")


def test_bad_valid_kv_len_is_rejected_before_communication():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        q = torch.zeros(1, 4, 2, 8)
        with pytest.raises(ValueError, match=r"valid_kv_len must be in \[1, 4\]"):
            ring_attention(q, q, q, None, valid_kv_len=5)
        with pytest.raises(ValueError, match=r"valid_kv_len must be in \[1, 4\]"):
            ulysses_attention(q, q, q, None, valid_kv_len=0)
    finally:
        dist.destroy_process_group()
