"""`wanmesh bench pool`'s chunk hand-over measurement: both transports deliver the chunk, every shared-memory
segment it made is gone afterwards, and the table shows each row."""

from __future__ import annotations

import os

import torch

from wanmesh.parallel import transport
from wanmesh.parallel.bench import pool as bench_pool
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.transport import SHM_DIR


def test_chunk_handover_is_measured_and_leaves_no_segment(monkeypatch):
    prefix = transport.new_segment_prefix()
    monkeypatch.setattr(bench_pool, "new_segment_prefix", lambda: prefix)
    taken = []
    monkeypatch.setattr(bench_pool, "take_handed_over", lambda packed: taken.append(transport.take_handed_over(packed)))
    results = bench_pool.measure_chunk_handover(frames=5, height=16, width=32, repeats=3)
    assert len(taken) == 4 and all(t["frames"].shape == (5, 16, 32, 3) for t in taken)  # warm-up + 3
    assert all(t["latents"].shape == (1, 16, 2, 2, 4) and t["latents"].dtype == torch.float32 for t in taken)
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    for key in ("chunk_shm_held", "chunk_pipe_held", "chunk_shm_received", "chunk_pipe_received"):
        low, high = results[f"{key}_spread_ms"]
        assert 0 < low <= results[f"{key}_ms"] <= high
    table = bench_pool.format_table(ParallelConfig(world=1, devices="cpu"), (5, 16, 32, 3), {
        "empty_request_ms": 1.0, "empty_request_p90_ms": 2.0, "tensor_mib": 1.0, "pool_round_trip_s": 0.1,
        "pool_gib_per_s": 1.0, "copy_s": 0.1, "copy_gib_per_s": 1.0, "ratio": 1.0, **results})
    assert "sender held, shared memory" in table and "until received, pickled through a pipe" in table


def test_a_handed_over_segment_keeps_other_values_and_is_unlinked_once_taken():
    prefix = transport.new_segment_prefix()
    frames = torch.arange(24, dtype=torch.float32).reshape(2, 2, 2, 3)
    packed = transport.pack_handed_over({"index": 3, "frames": frames, "none": None}, f"{prefix}_c1")
    names = transport.segment_names(packed)
    assert len(names) == 1 and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    taken = transport.take_handed_over(packed)
    assert taken["index"] == 3 and taken["none"] is None
    torch.testing.assert_close(taken["frames"], frames, rtol=0, atol=0)
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


def test_pool_starts_are_timed_both_ways_and_the_workers_have_the_parent_each_way_gives():
    """One warm-up and one timed start of each way on a 1-rank CPU pool: the template's workers are its children,
    the others are not, and the table shows both rows."""
    config = ParallelConfig(world=1, devices="cpu")
    results = bench_pool.measure_pool_starts(config, repeats=1)
    assert results["start_template_forked"] is True and results["start_fresh_forked"] is False
    for way in ("template", "fresh"):
        low, high = results[f"start_{way}_spread_s"]
        assert 0 < low <= results[f"start_{way}_s"] <= high
    assert results["start_ratio"] == results["start_fresh_s"] / results["start_template_s"]
    table = bench_pool.format_table(config, (5, 16, 32, 3), {
        "empty_request_ms": 1.0, "empty_request_p90_ms": 2.0, "tensor_mib": 1.0, "pool_round_trip_s": 0.1,
        "pool_gib_per_s": 1.0, "copy_s": 0.1, "copy_gib_per_s": 1.0, "ratio": 1.0,
        **bench_pool.measure_chunk_handover(frames=1, height=8, width=8, repeats=1), **results})
    assert "workers forked from the template" in table and "each worker importing its code" in table
