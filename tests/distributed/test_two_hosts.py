"""The Ray backend across two hosts: two network namespaces joined by a veth pair (tests/tools/two_hosts.py), a
Ray head node in the first, a worker node in the second, 2 CPU slots each, one cluster for the whole module.

The drivers run inside the first namespace (``ip netns exec``), so the pool's rendezvous must use the head
host's veth address and interface, never loopback: world 4 (tp 2 inside each host, CFG parallel or Ulysses
across hosts) equals world 1, through the pool and through ``wanmesh generate --backend ray --ray-address``.
Last, the second host's raylet is killed mid-sample: the call names the host and its ranks, the next call on
the same pool says what is missing, nothing of the pool is left on the first host, and a pool that fits what
is left runs. Skipped only where namespaces cannot be made (not root, no iproute2, no Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from two_hosts import two_hosts, unavailable_reason  # noqa: E402

DRIVER = str(Path(__file__).with_name("two_hosts_driver.py"))
DRIVER_TIMEOUT_S = 240
WORKER_TIMEOUT_S = 60.0  # the default worker_timeout: a lost host must be named within it
TOLERANCE = 1e-4  # tp changes the reduction order of the tiny model's matmuls, as on one host

_reason = unavailable_reason()
if _reason and os.environ.get("CI") == "true" and os.geteuid() == 0:
    raise RuntimeError(f"the two-host tests must run in CI as root, but: {_reason}")
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"two hosts cannot be made here: {_reason}")


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module; every driver below is bounded by DRIVER_TIMEOUT_S (no faulthandler exit here:
    it would skip the teardown, though the next run removes namespaces whose creator is gone)."""
    with two_hosts() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return str(tiny_models["t2v"])


def drive(mode: str, spec: dict, out: Path, cluster=None) -> dict:
    command = [sys.executable, DRIVER, mode, json.dumps(spec), str(out)]
    if cluster is not None:
        command = cluster.head.exec(*command)
    done = subprocess.run(command, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
                          env={**os.environ, **(cluster.env if cluster else {})})
    assert done.returncode == 0, f"the driver failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def world_one(model, tmp_path_factory) -> torch.Tensor:
    out = tmp_path_factory.mktemp("world1") / "world1.json"
    drive("sample", {"backend": "local", "model": model, "steps": 2, "layout": {"world": 1}}, out)
    return torch.load(out.with_suffix(".pt"))


def test_world_four_on_two_hosts_equals_world_one(cluster, model, world_one, tmp_path):
    """tp 2 inside each host, CFG parallel across them; the store on the head's veth address; gloo on the veth."""
    spec = {"backend": "ray", "address": cluster.address, "model": model, "steps": 2,
            "layout": {"world": 4, "tp": 2, "cfg_parallel": True}}
    seen = drive("sample", spec, tmp_path / "w4.json", cluster)
    head, worker = cluster.head, cluster.worker
    assert seen["hosts"] == [head.address, head.address, worker.address, worker.address]
    assert seen["driver"] == head.address
    assert seen["store"].rsplit(":", 1)[0] == head.address
    assert [i["GLOO_SOCKET_IFNAME"] for i in seen["interfaces"]] == [head.device] * 2 + [worker.device] * 2
    assert all(i["NCCL_SOCKET_IFNAME"] == i["GLOO_SOCKET_IFNAME"] for i in seen["interfaces"])
    latents = torch.load((tmp_path / "w4.json").with_suffix(".pt"))
    assert latents.shape == world_one.shape and world_one.std() > 0.1
    assert (latents - world_one).abs().max() <= TOLERANCE


def test_generate_command_line_on_two_hosts(cluster, tiny_models_root, tmp_path):
    """`wanmesh generate --backend ray --ray-address` from the head host: tp 2 x Ulysses 2 equals one local rank."""
    common = ["-m", "wanmesh.parallel.cli", "generate", "--models", str(tiny_models_root), "--prompt", "a lighthouse",
              "--width", "64", "--height", "48", "--frames", "5", "--steps", "2", "--seed", "5", "--device", "cpu"]
    runs = {"one": [sys.executable, *common, "--world", "1"],
            "two_hosts": cluster.head.exec(sys.executable, *common, "--world", "4", "--tp", "2", "--ulysses", "2",
                                           "--backend", "ray", "--ray-address", cluster.address)}
    latents = {}
    for name, command in runs.items():
        out = tmp_path / f"{name}.safetensors"
        done = subprocess.run([*command, "--out", str(tmp_path / f"{name}.mp4"), "--save-latents", str(out)],
                              capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
                              env={**os.environ, **cluster.env})
        assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
        latents[name] = load_file(out)["latents"]
    assert (latents["two_hosts"] - latents["one"]).abs().max() <= TOLERANCE


def test_a_host_lost_mid_sample_is_named_and_what_is_left_still_works(cluster, model, world_one, tmp_path):
    """Runs last: it kills the second host's Ray node."""
    raylet = cluster.worker.raylet_pid()
    assert raylet is not None
    spec = {"backend": "ray", "address": cluster.address, "model": model, "steps": 2, "raylet_pid": raylet}
    seen = drive("lose", spec, tmp_path / "lose.json", cluster)
    worker, head = cluster.worker.address, cluster.head.address
    assert seen["placement"]["hosts"] == [head, head, worker, worker]
    error = seen["error"]
    assert error is not None and "\n" not in error and len(error) <= 300, error
    assert f"host {worker} was lost with ranks 2, 3" in error and "WorkerDied" in error
    assert seen["error_after_s"] < WORKER_TIMEOUT_S
    assert seen["next"].startswith("ValueError: world=4 needs 4 CPU slots"), seen["next"]
    assert f"({head}: 2)" in seen["next"] and f"hosts that left the cluster: {worker}" in seen["next"]
    assert seen["leftovers"] == []
    assert seen["after"]["hosts"] == [head, head]
    after = torch.load((tmp_path / "lose.json").with_suffix(".pt"))
    assert (after - world_one).abs().max() <= TOLERANCE
