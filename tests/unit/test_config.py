"""ParallelConfig: the layout, derived degrees and up-front validation with messages that name the numbers."""

import pytest

from wanmesh.parallel.config import MESH_DIMS, ParallelConfig, rank_coordinates


def test_dp_fills_what_the_other_degrees_leave():
    config = ParallelConfig(world=8, tp=2, cfg_parallel=True)
    assert (config.cfg_degree, config.model_parallel, config.dp) == (2, 4, 2)
    assert config.mesh_shape == (2, 2, 1, 1, 2)


def test_rank_coordinates_are_row_major_with_tp_fastest():
    config = ParallelConfig(world=8, tp=2, ring=2, devices="cpu")
    coords = [rank_coordinates(config, r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["ring"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    # every rank has distinct coordinates, and they cover the mesh
    assert len({tuple(c[d] for d in MESH_DIMS) for c in coords}) == 8
    with pytest.raises(ValueError, match="rank 8 is outside world=8"):
        rank_coordinates(config, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world=6, tp=4), r"world=6 is not a multiple of cfg x ulysses x ring x tp = 1 x 1 x 1 x 4 = 4; .*valid worlds are 4, 8"),
        (dict(world=2, cfg_parallel=True, ulysses=2), r"= 2 x 2 x 1 x 1 = 4"),
        (dict(world=0), r"world must be a positive integer, got 0"),
        (dict(world=2, tp=1.5), r"tp must be a positive integer, got 1.5"),
        (dict(world=1, backend="mpi"), r"backend 'mpi' is unknown; valid backends: local, ray"),
        (dict(world=2, devices="cuda:0"), r"world=2 ranks but only 1 devices are listed \(cuda:0\)"),
        (dict(world=2, devices="cuda:1,cuda:1"), r"names a GPU twice"),
        (dict(world=1, devices="tpu:0"), r"device 'tpu:0' .* is not valid"),
    ],
)
def test_invalid_configs_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_check_heads_names_heads_and_valid_splits():
    ParallelConfig(world=4, tp=2, ulysses=2).check_heads(12)
    with pytest.raises(ValueError, match=r"6 attention heads.*tp x ulysses = 2 x 2 = 4.*one of 1, 2, 3, 6"):
        ParallelConfig(world=4, tp=2, ulysses=2).check_heads(6)


def test_rank_devices():
    assert ParallelConfig(world=3, devices="cpu").rank_devices() == ["cpu"] * 3
    assert ParallelConfig(world=2, devices="auto").rank_devices(cuda_count=0) == ["cpu", "cpu"]
    assert ParallelConfig(world=2, devices="auto").rank_devices(cuda_count=4) == ["cuda:0", "cuda:1"]
    assert ParallelConfig(world=2, devices="cuda:3,cuda:1,cuda:0").rank_devices(cuda_count=4) == ["cuda:3", "cuda:1"]
    with pytest.raises(ValueError, match="world=3 ranks need 3 GPUs but 2 are visible; lower world to at most 2"):
        ParallelConfig(world=3, devices="cuda").rank_devices(cuda_count=2)
    with pytest.raises(ValueError, match=r"devices cuda:5 do not exist: this machine has 2 GPUs \(valid: cuda:0..cuda:1\)"):
        ParallelConfig(world=1, devices=["cuda:5"]).rank_devices(cuda_count=2)


def test_ray_ranks_are_not_counted_against_this_machine():
    """Ray places ranks on the cluster (it checks the cluster's GPUs at start): this machine's GPUs say nothing."""
    from wanmesh.parallel.config import ranks_over_cores_warning
    from wanmesh.parallel.gpus import machine_gpus

    world = machine_gpus().count + 1  # one more GPU than this machine has
    assert ranks_over_cores_warning(ParallelConfig(world=world, devices="cuda", backend="ray"), cpu_cores=1) is None
    with pytest.raises(ValueError, match=f"world={world} ranks need {world} GPUs"):
        ranks_over_cores_warning(ParallelConfig(world=world, devices="cuda", backend="local"), cpu_cores=1)


def test_plain_data_round_trip_and_equality():
    config = ParallelConfig(world=4, tp=2, cfg_parallel=True, devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    again = ParallelConfig.from_dict(config.to_dict())
    assert again == config and hash(again) == hash(config)
    assert ParallelConfig(world=4, tp=2) != ParallelConfig(world=4, tp=4)
    with pytest.raises(ValueError, match=r"unknown ParallelConfig fields \['pp'\]"):
        ParallelConfig.from_dict({"world": 1, "pp": 2})
