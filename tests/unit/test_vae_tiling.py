"""Unit tests of the patch executor (workload balancing, local split/exec/merge) and the tiled Wan VAE on one device."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch

from wanmesh.parallel.distributed.patch_parallel import TileTask, assign_by_workload, effective_patch_size, run_patch_parallel
from wanmesh.parallel.networks.vae_tiling import (
    merge_blended,
    resolve_tile_options,
    split_spatial,
    tile_spans,
    decode_raw,
    tiled_decode,
    tiled_encode,
)


def _tasks(workloads: list[float]) -> list[TileTask]:
    return [TileTask(id=i, coord=(i,), inputs=(), workload=w) for i, w in enumerate(workloads)]


def _loads(buckets: list[list[TileTask]]) -> list[float]:
    return [sum(t.workload for t in bucket) for bucket in buckets]


def _optimal_makespan(workloads: list[float], world: int) -> float:
    """Brute force over every assignment: the independent reference for small task sets."""
    best = float("inf")
    for owners in itertools.product(range(world), repeat=len(workloads)):
        loads = [0.0] * world
        for owner, w in zip(owners, workloads):
            loads[owner] += w
        best = min(best, max(loads))
    return best


# ---- workload balancing ---------------------------------------------------------------------------------------------


def test_assignment_balances_workload_not_count():
    # One big tile and six small ones: by count each rank would get 3-4 tiles; by workload the big one stands alone.
    buckets = assign_by_workload(_tasks([12, 2, 2, 2, 2, 2, 2]), world=2)
    assert [[t.id for t in b] for b in buckets] == [[0], [1, 2, 3, 4, 5, 6]]
    assert _loads(buckets) == [12, 12]


def test_assignment_hand_worked_example():
    # LPT by hand: 7->r0, 5->r1, 4->r2, 3->r2 (4<5<7), 3->r1 (5<7), 2->r2 (7,8,7 -> r0 and r2 tie at 7: lowest rank r0).
    buckets = assign_by_workload(_tasks([3, 7, 2, 5, 4, 3]), world=3)
    assert [[t.id for t in b] for b in buckets] == [[1, 2], [3, 5], [0, 4]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_assignment_is_complete_deterministic_and_near_optimal(world):
    rng = random.Random(world)
    for _ in range(20):
        workloads = [float(rng.randint(1, 16)) for _ in range(rng.randint(1, 7))]
        tasks = _tasks(workloads)
        buckets = assign_by_workload(tasks, world)
        assert len(buckets) == world
        assert sorted(t.id for b in buckets for t in b) == list(range(len(tasks)))
        shuffled = tasks[:]
        rng.shuffle(shuffled)
        assert [[t.id for t in b] for b in assign_by_workload(shuffled, world)] == [[t.id for t in b] for b in buckets]
        # Graham's bound for longest-processing-time: makespan <= (4/3 - 1/(3m)) * optimum.
        bound = (4 / 3 - 1 / (3 * world)) * _optimal_makespan(workloads, world)
        assert max(_loads(buckets)) <= bound + 1e-9


def test_assignment_with_more_ranks_than_tasks_leaves_ranks_empty():
    buckets = assign_by_workload(_tasks([1, 1]), world=4)
    assert [len(b) for b in buckets] == [1, 1, 0, 0]


def test_assignment_rejects_bad_input():
    with pytest.raises(ValueError, match="world"):
        assign_by_workload(_tasks([1]), world=0)
    with pytest.raises(ValueError, match="unique"):
        assign_by_workload([TileTask(0, (0,), (), 1.0), TileTask(0, (1,), (), 1.0)], world=2)
    with pytest.raises(ValueError, match="non-negative"):
        assign_by_workload(_tasks([1, -2]), world=2)


def test_patch_size_larger_than_pool_falls_back_with_a_note(caplog):
    with caplog.at_level(logging.WARNING):
        assert effective_patch_size(8, pool_size=2) == 2
    assert "vae_patch=8" in caplog.text
    assert effective_patch_size(2, pool_size=4) == 2
    with pytest.raises(ValueError, match="vae_patch"):
        effective_patch_size(0, pool_size=2)


# ---- split / merge ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile,overlap", [(4, 1), (8, 2), (8, 4), (6, 0)])
def test_tile_spans_cover_with_exact_overlaps(tile, overlap):
    for size in range(1, 40):
        spans = tile_spans(size, tile, overlap)
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(end - start <= tile for start, end in spans)
        for (_, end0), (start1, end1) in zip(spans, spans[1:]):
            assert end0 - start1 == overlap  # neighbours share exactly the overlap
            assert end1 - start1 > overlap  # no tile lies inside its neighbour


@pytest.mark.parametrize("shape", [(2, 3, 10, 11), (1, 1, 9, 4), (1, 2, 3, 5)])
def test_identity_tiles_merge_back_to_the_input(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tasks, grid = split_spatial(x, tile=4, overlap=1, out_scale=1)
    merged = merge_blended({t.coord: t.inputs[0] for t in tasks}, grid)
    torch.testing.assert_close(merged, x, rtol=0, atol=1e-12)


def test_scaled_tiles_merge_like_the_whole():
    # An exec that upsamples each tile by nearest neighbour commutes with tiling, so blending must reproduce the whole.
    x = torch.randn(1, 2, 3, 7, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def upsample(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(8, dim=-2).repeat_interleave(8, dim=-1)

    merged = run_patch_parallel(
        x,
        lambda v: split_spatial(v, tile=4, overlap=1, out_scale=8),
        lambda task: upsample(task.inputs[0]),
        merge_blended,
    )
    torch.testing.assert_close(merged, upsample(x), rtol=0, atol=1e-12)


def test_tile_options_default_overlap_and_errors():
    assert resolve_tile_options(256, None, 8) == (256, 64)
    assert resolve_tile_options(40, None, 8) == (40, 8)
    assert resolve_tile_options(32, 0, 8) == (32, 0)
    bad = [(30, None, "tile_px"), (0, None, "tile_px"), (64, 4, "overlap_px"), (64, 40, "overlap_px")]
    for tile_px, overlap_px, match in bad:
        with pytest.raises(ValueError, match=match):
            resolve_tile_options(tile_px, overlap_px, 8)


def test_decode_tile_options_follow_native_vae_decode_tiled():
    """Native lowers an overlap above a quarter of the tile to a quarter and divides both by the VAE's factor."""
    assert resolve_tile_options(64, 40, 8, decode=True) == (64, 16)  # an encode refuses 40 (more than half)
    assert resolve_tile_options(64, 24, 8, decode=True) == (64, 16)  # an encode keeps 24
    assert resolve_tile_options(64, 24, 8) == (64, 24)
    assert resolve_tile_options(100, 20, 8, decode=True) == (96, 16)
    assert resolve_tile_options(256, 48, 16, decode=True) == (256, 48)
    assert resolve_tile_options(256, None, 16, decode=True) == (256, 64)
    for tile_px, overlap_px in ((4, None), (64, -8), (64, 1.5)):
        with pytest.raises(ValueError, match="tile_px|overlap_px"):
            resolve_tile_options(tile_px, overlap_px, 8, decode=True)


# ---- the tiny Wan VAE ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    )
    return vae.eval()


def test_decode_with_one_tile_equals_the_vae(tiny_vae):
    latents = torch.randn(1, 16, 2, 6, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = tiny_vae.decode(latents).sample
    assert reference.std() > 0.05  # the random VAE gives non-degenerate pixels
    raw = tiled_decode(tiny_vae, latents, tile_px=64)  # raw pixels: diffusers' decode clamps, ours clamps later
    assert raw.abs().max() > 1  # the random VAE overshoots, so the comparison below sees the clamp's place
    torch.testing.assert_close(raw.clamp(-1, 1), reference, rtol=0, atol=1e-6)


def test_encode_with_one_tile_equals_the_vae(tiny_vae):
    pixels = torch.rand(1, 3, 5, 48, 40, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        reference = tiny_vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(tiled_encode(tiny_vae, pixels, tile_px=64), reference, rtol=0, atol=1e-6)


def test_tiled_versus_untiled_report(tiny_vae, record_property):
    """Reports (does not assert) how far small tiles drift from a whole-frame pass; the shapes must agree."""
    latents = torch.randn(1, 16, 2, 7, 6, generator=torch.Generator().manual_seed(3))
    pixels = torch.rand(1, 3, 5, 48, 40, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        whole_pixels = decode_raw(tiny_vae, latents)
        whole_latents = tiny_vae.encode(pixels).latent_dist.mode()
    tiled_pixels = tiled_decode(tiny_vae, latents, tile_px=32)
    tiled_latents = tiled_encode(tiny_vae, pixels, tile_px=32)
    assert tiled_pixels.shape == whole_pixels.shape and tiled_latents.shape == whole_latents.shape
    for name, tiled, whole in [("decode", tiled_pixels, whole_pixels), ("encode", tiled_latents, whole_latents)]:
        diff = (tiled - whole).abs()
        record_property(f"{name}_max_abs_diff", float(diff.max()))
        print(f"tiled vs untiled {name} (32 px tiles, 8 px overlap): max {diff.max():.4f}, mean {diff.mean():.4f}")


def test_bad_inputs_get_clear_errors_before_work(tiny_vae):
    with pytest.raises(ValueError, match=r"\[B, 16, T, h, w\]"):
        tiled_decode(tiny_vae, torch.zeros(1, 4, 2, 4, 4))
    with pytest.raises(ValueError, match="frame count 0 is not a positive number of frames"):  # any count >= 1 encodes
        tiled_encode(tiny_vae, torch.zeros(1, 3, 0, 16, 16))
    with pytest.raises(ValueError, match="height 20 is not a positive multiple of 8"):
        tiled_encode(tiny_vae, torch.zeros(1, 3, 5, 20, 16))
    with pytest.raises(ValueError, match="tile_px"):  # a decode cuts 12 to 8 as native; an encode refuses it
        tiled_encode(tiny_vae, torch.zeros(1, 3, 5, 16, 16), tile_px=12)
    with pytest.raises(ValueError, match="tile_px"):
        tiled_decode(tiny_vae, torch.zeros(1, 16, 2, 4, 4), tile_px=4)
