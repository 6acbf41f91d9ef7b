"""The Ray backend's decisions that need no cluster: rank order by host, the slots check, the interface towards
rank 0, and the KubeRay manifest in docs/ (valid YAML with the fields KubeRay needs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from wanmesh.parallel.config import ParallelConfig, rank_coordinates
from wanmesh.parallel.driver.ray_backend import check_slots, interface_towards, order_by_host

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "kuberay-raycluster.yaml"


def node(ip: str, cpus: float, alive: bool = True) -> dict:
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": cpus}}


def test_ranks_of_a_host_are_consecutive_so_tp_groups_stay_inside_it():
    # actors as Ray placed them: interleaved over two hosts, the driver on 10.0.0.9
    placed = [("b", "10.0.0.2"), ("a", "10.0.0.9"), ("b", "10.0.0.2"), ("a", "10.0.0.9")]
    order = order_by_host(placed, driver_ip="10.0.0.9")
    hosts = [placed[i][1] for i in order]
    assert hosts == ["10.0.0.9", "10.0.0.9", "10.0.0.2", "10.0.0.2"]
    config = ParallelConfig(world=4, tp=2, cfg_parallel=True, devices="cpu")
    tp_groups: dict[int, set[str]] = {}
    for rank, host in enumerate(hosts):
        tp_groups.setdefault(rank_coordinates(config, rank)["cfg"], set()).add(host)
    assert all(len(group) == 1 for group in tp_groups.values())


def test_the_host_with_more_ranks_comes_first():
    placed = [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b", "10.0.0.2"), ("b", "10.0.0.2")]
    assert [placed[i][1] for i in order_by_host(placed, "10.0.0.1")] == ["10.0.0.2"] * 3 + ["10.0.0.1"]


def test_fewer_slots_than_the_world_names_each_hosts_slots_and_the_hosts_gone():
    nodes = [node("10.0.0.1", 2), node("10.0.0.2", 1), node("10.0.0.3", 4, alive=False)]
    with pytest.raises(ValueError) as caught:
        check_slots(4, "CPU", nodes, "10.0.0.1:6379")
    message = str(caught.value)
    assert message.startswith("world=4 needs 4 CPU slots but the Ray cluster at 10.0.0.1:6379 has 3 "
                              "(10.0.0.1: 2, 10.0.0.2: 1); hosts that left the cluster: 10.0.0.3")
    assert "\n" not in message and len(message) <= 300
    check_slots(3, "CPU", nodes, "10.0.0.1:6379")  # enough: no error


def test_the_interface_towards_this_machines_loopback_is_lo():
    assert interface_towards("127.0.0.1") == "lo"


def test_the_kuberay_manifest_is_a_raycluster_with_gpu_workers():
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    head = manifest["spec"]["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"]
    workers = manifest["spec"]["workerGroupSpecs"]
    assert workers and all(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] > 0
                           for w in workers)
    assert all(isinstance(v, str) for group in [head, *workers] for v in group["rayStartParams"].values())
