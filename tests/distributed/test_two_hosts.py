"""The Ray backend across two hosts: two network namespaces joined by a veth pair (tests/tools/two_hosts.py), a
Ray head node in the first, a worker node in the second, 2 CPU slots each, one cluster for the whole module.

The drivers run inside the first namespace (``ip netns exec``), so the pool's rendezvous must use the head
host's veth address and interface, never loopback: world 4 (tp 2 inside each host, CFG parallel or Ulysses
across hosts) equals world 1, through the pool and through ``wanmesh generate --backend ray --ray-address``.
Last, the second host's raylet is killed mid-sample: the call names the host and its ranks, the next call on
the same pool says what is missing, and nothing of the pool is left on the first host. Skipped only where namespaces cannot be made (not root, no iproute2, no Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_generate_command_line_on_two_hosts(cluster, tiny_models_root, tmp_path):
    """`wanmesh generate --backend ray --ray-address` from the head host: tp 2 x Ulysses 2 equals one local rank."""
    common = ["-m", "wanmesh.parallel.cli", "generate", "--models", str(tiny_models_root), "--prompt", "a lighthouse",
              "--width", "64", "--height", "48", "--frames", "5", "--steps", "2", "--seed", "5", "--device", "cpu"]
    runs = {"one": [sys.executable, *common, "--world", "1"],
            "two_hosts": cluster.head.exec(sys.executable, *common, "--world", "4", "--tp", "2", "--ulysses", "2",
                                           "--backend", "ray", "--ray-address", cluster.address)}
    running = {name: subprocess.Popen([*command, "--out", str(tmp_path / f"{name}.mp4"), "--save-latents",
                                       str(tmp_path / f"{name}.safetensors")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env={**os.environ, **cluster.env})
               for name, command in runs.items()}  # at once: the reference runs while the actors start
    latents = {}
    try:
        for name, proc in running.items():
            _, err = proc.communicate(timeout=DRIVER_TIMEOUT_S)
            assert proc.returncode == 0, f"{name}: {err[-4000:]}"
            latents[name] = load_file(tmp_path / f"{name}.safetensors")["latents"]
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (latents["two_hosts"] - latents["one"]).abs().max() <= TOLERANCE


def test_world_four_equals_world_one_then_a_host_lost_mid_sample_is_named(cluster, model, tmp_path):
    """tp 2 inside each host, CFG parallel across them, the store on the head's veth address and gloo on the veth,
    equal to one local rank; then the second host's raylet is killed mid-sample. Runs last: it ends that node."""
    raylet = cluster.worker.raylet_pid()
    assert raylet is not None
    spec = {"backend": "ray", "address": cluster.address, "model": model, "steps": 2, "raylet_pid": raylet}
    seen = drive("lose", spec, tmp_path / "lose.json", cluster)
    head, worker = cluster.head, cluster.worker
    placed = seen["placement"]
    assert placed["hosts"] == [head.address, head.address, worker.address, worker.address]
    assert placed["driver"] == head.address and placed["store"].rsplit(":", 1)[0] == head.address
    assert [i["GLOO_SOCKET_IFNAME"] for i in placed["interfaces"]] == [head.device] * 2 + [worker.device] * 2
    assert all(i["NCCL_SOCKET_IFNAME"] == i["GLOO_SOCKET_IFNAME"] for i in placed["interfaces"])
    assert placed["text"] == f"ranks 0-1 on {head.address} ({head.device}), ranks 2-3 on {worker.address} " \
                             f"({worker.device})"
    assert seen["reference_std"] > 0.1 and seen["difference"] <= TOLERANCE

    error = seen["error"]
    assert error is not None and "\n" not in error and len(error) <= 300, error
    assert error.startswith(f"rank 2: WorkerDied: host {worker.address} was lost with ranks 2, 3 (ranks 0, 1 on "
                            f"{head.address} remain) during sample"), error
    assert seen["error_after_s"] < WORKER_TIMEOUT_S
    assert seen["next"].startswith(f"ValueError: world=4 needs 4 CPU slots but the Ray cluster at {cluster.address} "
                                   f"has 2 ({head.address}: 2); hosts that left the cluster: {worker.address}"), \
        seen["next"]
    assert seen["leftovers"] == []
