"""The Wan 2.2 VAE on a real pool: decode and encode with VAE patch parallelism (vae_patch 2: two CPU ranks share the
tiles) equal one rank's executor, tiled (16 px multiples: 32 px tiles, 16 px overlap, a 2x3 grid at 64x48 px) and with
the default tile (one tile here, so the whole-frame result); 48-channel latents go through the driver and back."""

from __future__ import annotations

import pytest
import torch

from pool_helpers import cpu_pool, one_thread_per_worker, traceback_deadline  # noqa: F401 (autouse fixture)
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.tiny.vae22 import write_tiny_vae22
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 400
FRAMES = (5, 48, 64, 3)
LATENTS = (1, 48, 2, 3, 4)
TILE = dict(tile_px=32, overlap_px=16)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    return torch.rand(*FRAMES, generator=generator), torch.randn(*LATENTS, generator=generator)


def _run(engine, vae_file: str) -> dict[str, torch.Tensor]:
    frames, latents = _inputs()
    vae = engine.load_vae(vae_file, dtype="fp32")
    return {"decode_tiled": engine.decode(vae, latents, **TILE), "encode_tiled": engine.encode(vae, frames, **TILE),
            "decode": engine.decode(vae, latents), "encode": engine.encode(vae, frames)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict]:
    with traceback_deadline(DEADLINE_S):
        vae_file = str(write_tiny_vae22(tmp_path_factory.mktemp("models")))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the reference runs one thread, as each worker does
        try:
            one_rank = _run(RankExecutor("cpu"), vae_file)
        finally:
            torch.set_num_threads(threads)
        with cpu_pool(world=2, vae_patch=2) as pool:
            shared = _run(PoolRunner(pool), vae_file)
    return one_rank, shared


def test_vae_patch_2_decode_and_encode_equal_one_rank(results):
    one_rank, shared = results
    assert one_rank["decode_tiled"].shape == one_rank["decode"].shape == FRAMES
    assert one_rank["encode_tiled"].shape == one_rank["encode"].shape == LATENTS
    for name, expected in one_rank.items():
        assert float(expected.std()) > 0.05, name
        torch.testing.assert_close(shared[name], expected, rtol=0, atol=1e-5, msg=name)


def test_the_tiles_differ_from_whole_frames_so_the_grid_was_used(results):
    one_rank, _ = results
    assert float((one_rank["decode_tiled"] - one_rank["decode"]).abs().max()) > 1e-3
    assert float((one_rank["encode_tiled"] - one_rank["encode"]).abs().max()) > 1e-3
