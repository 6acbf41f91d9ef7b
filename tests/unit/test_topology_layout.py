"""The auto layout on ranks spread over hosts (``parallel/auto_layout.py``, ``parallel/calibration.py``), on a
made-up two-host topology (no Ray): which groups of a layout cross hosts (checked against the mesh's own rank
coordinates), collectives of crossing groups priced on the link across hosts, the choice keeping tensor
parallelism inside a host, the table's column, and nothing changed on one host. Last, the probe's pair
measurements on four real gloo ranks that report two hosts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from wanmesh.parallel import calibration
from wanmesh.parallel.auto_layout import (CROSS_HOST_COLUMN, Job, Layout, Link, Machine, ModelCost,
                                          candidate_layouts, choose, crossing_groups, explain, group_ranks, predict)
from wanmesh.parallel.config import ParallelConfig, rank_coordinates
from wanmesh.parallel.distributed.spawn import spawn_ranks

SMALL = ModelCost(layers=8, heads=16, head_dim=64, ffn_dim=4096, weight_bytes=280 * 2**20)
GUIDED = Job(832, 480, 81, steps=30)
UNGUIDED = Job(832, 480, 81, steps=30, guidance=False)
KINDS = ("all_reduce", "all_to_all", "send_recv")
FAST, SLOW = Link(1e-5, 1e11), Link(1e-3, 1e8)  # a host's own links; a slow network between hosts
ONE_HOST = Machine(matmul_flops=1e11, attention_flops=1e11, all_reduce=FAST, all_to_all=FAST, send_recv=FAST,
                   free_bytes=80 * 2**30)


def on_hosts(machine: Machine, rank_hosts: tuple[int, ...], across: Link = SLOW) -> Machine:
    return replace(machine, rank_hosts=rank_hosts, host_links=tuple(("across", kind, across) for kind in KINDS)
                   + tuple(("inside", kind, FAST) for kind in KINDS))


TWO_HOSTS = on_hosts(ONE_HOST, (0, 0, 1, 1))


@pytest.mark.parametrize("world", [4, 8])
def test_group_ranks_are_the_mesh_groups(world):
    """Each group of a dimension holds the ranks whose mesh coordinates differ only along it."""
    for layout in candidate_layouts(world, SMALL, GUIDED):
        config = layout.applied_to(ParallelConfig(world=world, devices="cpu"))
        coordinates = [rank_coordinates(config, rank) for rank in range(world)]
        for dim in ("tp", "ring", "ulysses", "cfg"):
            groups = group_ranks(layout, world, dim)
            assert sorted(rank for group in groups for rank in group) == list(range(world)), (layout, dim)
            for group in groups:
                others = [{k: v for k, v in coordinates[rank].items() if k != dim} for rank in group]
                assert all(other == others[0] for other in others), (layout, dim, group)
                assert sorted(coordinates[rank][dim] for rank in group) == list(range(len(group))), (layout, dim)


def test_which_groups_cross_two_hosts_of_two_ranks():
    hosts = (0, 0, 1, 1)
    assert crossing_groups(Layout(tp=4), 4, hosts) == ("tp",)
    assert crossing_groups(Layout(tp=2, cfg_parallel=True), 4, hosts) == ("cfg",)
    assert crossing_groups(Layout(tp=2, ulysses=2), 4, hosts) == ("ulysses",)
    assert crossing_groups(Layout(ulysses=2, ring=2), 4, hosts) == ("ulysses",)
    assert crossing_groups(Layout(ring=4), 4, hosts) == ("ring",)
    assert crossing_groups(Layout(tp=2), 4, hosts) == ()  # data parallel across hosts: no collective crosses
    assert crossing_groups(Layout(tp=4), 4, (0, 0, 0, 0)) == ()


@pytest.mark.parametrize("job", [GUIDED, UNGUIDED], ids=["guided", "unguided"])
def test_one_host_prices_and_chooses_as_before(job):
    """Hosts all equal (or the cross-host figures present but one host) change no price, order or table."""
    before = choose(4, SMALL, job, ONE_HOST)
    after = choose(4, SMALL, job, on_hosts(ONE_HOST, (0, 0, 0, 0)))
    assert [(p.layout, p.step_s, p.communication_s) for p in after] == \
           [(p.layout, p.step_s, p.communication_s) for p in before]
    assert all(p.cross_host is None for p in after)
    assert explain(after, job, shown=20) == explain(before, job, shown=20)
    assert CROSS_HOST_COLUMN not in explain(after, job)


def test_crossing_collectives_pay_the_link_across_hosts():
    for layout in candidate_layouts(4, SMALL, UNGUIDED):
        one = predict(layout, 4, SMALL, UNGUIDED, ONE_HOST)
        two = predict(layout, 4, SMALL, UNGUIDED, TWO_HOSTS)
        assert two.compute_s == one.compute_s and two.memory_bytes == one.memory_bytes
        if two.cross_host:
            assert two.communication_s > one.communication_s * 10, layout
        else:
            assert two.communication_s == one.communication_s, layout
    # a network as fast as the host's own links: crossing costs nothing more
    same = on_hosts(ONE_HOST, (0, 0, 1, 1), across=FAST)
    tp4 = Layout(tp=4, vae_patch=4)
    assert predict(tp4, 4, SMALL, UNGUIDED, same).step_s == predict(tp4, 4, SMALL, UNGUIDED, ONE_HOST).step_s


def test_a_crossing_group_is_priced_at_the_worse_of_its_own_link_and_the_cross_host_pair():
    own = Link(5e-3, 1e12)  # a slower measured latency than the pair across, a faster bandwidth
    machine = replace(TWO_HOSTS, group_links=((4, "all_reduce", own),))
    assert machine.link("all_reduce", 4, crosses_hosts=True) == Link(5e-3, SLOW.bytes_per_s)
    assert machine.link("all_reduce", 4) == own
    assert ONE_HOST.link("all_reduce", 4, crosses_hosts=True) == FAST  # no pair across hosts was measured


def test_two_hosts_keep_tensor_parallelism_inside_a_host():
    """Without guidance one host picks tp 4; on two hosts with a slow link tp stays in pairs inside each host."""
    one = choose(4, SMALL, UNGUIDED, ONE_HOST)[0]
    two = choose(4, SMALL, UNGUIDED, TWO_HOSTS)
    assert one.layout.tp == 4
    assert two[0].layout.tp == 2 and "tp" not in two[0].cross_host, explain(two, UNGUIDED)
    assert two[0].cross_host in (("ring",), ("ulysses",))
    guided = choose(4, SMALL, GUIDED, TWO_HOSTS)[0]  # with guidance the halves run on the two hosts
    assert guided.layout.cfg_parallel and guided.cross_host == ("cfg",), explain([guided], GUIDED)


def test_the_table_names_the_groups_that_cross_hosts():
    ranked = choose(4, SMALL, UNGUIDED, TWO_HOSTS)
    table = explain(ranked, UNGUIDED, shown=len(ranked))
    lines = table.splitlines()
    assert lines[1].rstrip().endswith(CROSS_HOST_COLUMN)
    for prediction, line in zip(ranked, lines[2:]):
        assert line.rstrip().endswith(", ".join(prediction.cross_host) or "none"), line
    assert any(line.rstrip().endswith("  tp") for line in lines[2:])
    assert any(line.rstrip().endswith("  none") for line in lines[2:])


def test_the_figures_of_ranks_on_two_hosts_make_a_two_host_machine(tmp_path, monkeypatch):
    """``combine`` of ranks that name two hosts: each rank's host index and rank 0's pair links, through the
    cache's JSON and back; ranks on one host add nothing."""
    link = {"latency_s": 1e-4, "bytes_per_s": 1e9}
    kinds = {kind: link for kind in KINDS}
    rank = {"matmul_flops": 1e11, "matmul_flops_alone": 1e11, "attention_flops": 1e11, "free_bytes": 2**33,
            "matmul_flops_by_active": {"1": 1e11}, "group_links": {"4": kinds}, "group_links_alone": {},
            "busy_latencies": {"4": 0.0}, "cpu_cores": 2, "threads": 1,
            "host_links": {"inside": kinds, "across": {kind: {**link, "bytes_per_s": 1e7} for kind in KINDS}}}
    config = ParallelConfig(world=4, devices="cpu")
    ranks = [{**rank, "host": host} for host in ("10.0.0.2", "10.0.0.2", "10.0.0.1", "10.0.0.1")]
    figures = json.loads(json.dumps(calibration.combine(config, ranks)))
    machine = calibration.machine_from_dict(figures)
    assert figures["hosts"] == [r["host"] for r in ranks] and machine.rank_hosts == (0, 0, 1, 1)
    assert machine.hosts == 2 and machine.across_hosts("all_reduce", Link(1e-5, 1e10)) == Link(1e-4, 1e7)
    one = calibration.combine(config, [{**rank, "host": "box"} for _ in range(4)])
    assert "rank_hosts" not in one and calibration.machine_from_dict(one).hosts == 1


def test_a_ray_pool_is_cached_under_its_cluster_not_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path))
    local = calibration.cache_file(ParallelConfig(world=4, devices="cpu"))
    ray = calibration.cache_file(ParallelConfig(world=4, devices="cpu", backend="ray", ray_address="10.0.0.5:6379"))
    assert ray != local and ray.name.startswith("ray-10.0.0.5_6379-")


def _pair_links_on_two_hosts(rank: int, world: int, folder: str) -> None:
    """Four ranks that say they sit two on each of two hosts; rank 0 writes the pair links it measured."""
    import torch

    calibration.rank_host = lambda: f"host{rank // 2}"
    hosts = calibration._gathered(calibration.rank_host(), world)
    links = calibration._host_pair_links(hosts, torch.device("cpu"), 3)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"hosts": hosts, "host_links": links}))


def test_the_probe_times_a_pair_inside_a_host_and_a_pair_across(tmp_path):
    spawn_ranks(_pair_links_on_two_hosts, 4, args=(str(tmp_path),), deadline_s=120)
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["hosts"] == ["host0", "host0", "host1", "host1"]
    assert set(first["host_links"]) == {"inside", "across"}
    for where in ("inside", "across"):
        assert set(first["host_links"][where]) == set(KINDS)
        assert all(link["bytes_per_s"] > 0 and link["latency_s"] > 0 for link in first["host_links"][where].values())
    assert json.loads((tmp_path / "rank3.json").read_text())["host_links"] == {}  # in neither pair
