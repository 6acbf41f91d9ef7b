"""VAE patch parallelism on gloo: decode and encode over 2, 3 and 4 ranks equal the single-device tiled result.

One spawn of four ranks serves every case: process groups {0, 1}, {1, 2, 3} (whose rank 0 is global rank 1) and
{0, 1, 2, 3} run the same tiled decode / encode, and global rank 0 also computes the single-device reference in a
group of its own. Each rank saves what it got; the test process compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from wanmesh.parallel.distributed.spawn import spawn_ranks

WORLD = 4
PATCH_GROUPS = {2: [0, 1], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
DEADLINE_S = 300
PG_TIMEOUT_S = 120
TILE_PX = 32  # 4 latent pixels a tile, overlap 8 px = 1 latent pixel: stride 3 latents / 24 px

# Decode: 10x8 latents -> 3x3 tiles (last column 2 wide); 4x7 -> 1x2 tiles, fewer tiles than ranks, batch of 2.
DECODE_CASES = {"grid3x3": (1, 16, 2, 10, 8), "grid1x2": (2, 16, 2, 4, 7)}
# Encode: 72x64 pixels -> 3x3 tiles, the last row 24 px and the last column 16 px.
ENCODE_CASES = {"grid3x3": (1, 3, 5, 72, 64)}


def _tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    )
    return vae.eval()


def _decode_input(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _encode_input(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(2)) * 2 - 1


def _run_all(vae, group, tag: str, out_dir: Path) -> None:
    from wanmesh.parallel.networks.vae_tiling import tiled_decode, tiled_encode

    saved = {}
    for name, shape in DECODE_CASES.items():
        saved[f"decode_{name}"] = tiled_decode(vae, _decode_input(shape), tile_px=TILE_PX, group=group)
    for name, shape in ENCODE_CASES.items():
        saved[f"encode_{name}"] = tiled_encode(vae, _encode_input(shape), tile_px=TILE_PX, group=group)
    torch.save(saved, out_dir / f"{tag}_rank{dist.get_rank()}.pt")


def _rank_main(rank: int, world: int, out_dir: str) -> None:
    vae = _tiny_vae()
    # new_group is collective: every rank creates every group, in the same order.
    single = dist.new_group([0])
    groups = {size: dist.new_group(ranks) for size, ranks in PATCH_GROUPS.items()}
    if rank == 0:
        _run_all(vae, single, "single", Path(out_dir))
    for size, ranks in PATCH_GROUPS.items():
        if rank in ranks:
            _run_all(vae, groups[size], f"patch{size}", Path(out_dir))
    dist.barrier()


@pytest.fixture(scope="module")
def rank_outputs(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("vae_patch")
    spawn_ranks(_rank_main, WORLD, args=(str(out_dir),), deadline_s=DEADLINE_S, pg_timeout_s=PG_TIMEOUT_S)
    return out_dir


@pytest.mark.parametrize("patch", sorted(PATCH_GROUPS))
def test_patch_parallel_equals_single_device_tiled(rank_outputs, patch):
    reference = torch.load(rank_outputs / "single_rank0.pt")
    ranks = PATCH_GROUPS[patch]
    leader, others = ranks[0], ranks[1:]
    leader_out = torch.load(rank_outputs / f"patch{patch}_rank{leader}.pt")
    for key, expected in reference.items():
        assert expected is not None and expected.abs().max() > 0
        torch.testing.assert_close(leader_out[key], expected, rtol=0, atol=1e-5, msg=f"{key} with vae_patch {patch}")
    for rank in others:
        out = torch.load(rank_outputs / f"patch{patch}_rank{rank}.pt")
        for key, expected in reference.items():
            if key.startswith("decode"):
                assert out[key] is None, f"decode result should stay on the group's rank 0, rank {rank} got one"
            else:  # encode broadcasts the latents to every rank of the group
                torch.testing.assert_close(out[key], expected, rtol=0, atol=1e-5, msg=f"{key} on rank {rank}")


def test_single_device_reference_has_expected_shapes(rank_outputs):
    reference = torch.load(rank_outputs / "single_rank0.pt")
    assert reference["decode_grid3x3"].shape == (1, 3, 5, 80, 64)
    assert reference["decode_grid1x2"].shape == (2, 3, 5, 32, 56)
    assert reference["encode_grid3x3"].shape == (1, 16, 2, 9, 8)
