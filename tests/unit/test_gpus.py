"""The local pool's GPUs: ``cuda:N`` are the machine's GPUs (as ``nvidia-smi`` numbers them) even when the host
process is narrowed by ``CUDA_VISIBLE_DEVICES``, and each worker gets its GPU list set explicitly."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from wanmesh.parallel import gpus
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.gpus import MachineGpus, machine_gpus, worker_device_env

FOUR_GPUS = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}aaa)" for i in range(4))


@pytest.fixture(autouse=True)
def fresh_count():
    machine_gpus.cache_clear()
    yield
    machine_gpus.cache_clear()


def fake_nvidia_smi(folder, monkeypatch, listing: str, exit_code: int = 0) -> None:
    """An ``nvidia-smi`` first on PATH that prints ``listing`` and records the CUDA_VISIBLE_DEVICES it saw."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"seen=${{CUDA_VISIBLE_DEVICES-unset}}\" > {folder}/seen\n"
                      f"cat <<'END'\n{listing}\nEND\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(autouse=True)
def cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # the count must not depend on this machine's torch build


def test_a_narrowed_host_still_counts_every_gpu_of_the_machine(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, FOUR_GPUS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # e.g. ComfyUI started with --cuda-device 1
    assert machine_gpus() == MachineGpus(("0", "1", "2", "3"), "nvidia-smi")
    assert (tmp_path / "seen").read_text().strip() == "seen=unset"  # asked without the host's narrowing
    assert ParallelConfig(world=3, devices="cuda").rank_devices() == ["cuda:0", "cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match=r"devices cuda:4 do not exist: this machine has 4 GPUs \(valid: "
                                         r"cuda:0..cuda:3\)"):
        ParallelConfig(world=2, devices="cuda:3,cuda:4").rank_devices()


def test_mig_lines_and_a_failing_tool(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "GPU 0: A100 (UUID: GPU-x)\n  MIG 3g.40gb Device 0: (UUID: MIG-y)\n"
                                           "GPU 1: A100 (UUID: GPU-z)")
    assert machine_gpus().ids == ("0", "1")
    machine_gpus.cache_clear()
    fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA-SMI has failed", exit_code=9)
    assert machine_gpus().source.startswith("this process's CUDA view")


def test_a_torch_without_cuda_never_counts_what_nvidia_smi_lists(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, FOUR_GPUS)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine_gpus().count == 0 and not (tmp_path / "seen").exists()
    assert ParallelConfig(world=2, devices="auto").rank_devices() == ["cpu", "cpu"]


def test_without_nvidia_smi_cuda_n_is_the_hosts_nth_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    found = machine_gpus()
    assert found.ids == ("5", "7")
    env, devices = worker_device_env(["cuda:1"], found)
    assert env == {"CUDA_VISIBLE_DEVICES": "7"} and devices == ["cuda:0"]


def test_workers_see_exactly_the_pools_gpus_each_rank_its_own():
    machine = MachineGpus(("0", "1", "2", "3"), "nvidia-smi")
    env, devices = worker_device_env(["cuda:3", "cuda:1"], machine)
    assert env == {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert devices == ["cuda:1", "cuda:0"]  # machine GPU 3 is the second entry of "1,3"
    env, devices = worker_device_env(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], machine)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_a_cpu_pool_hides_every_gpu_and_never_asks_for_them(monkeypatch):
    monkeypatch.setattr(gpus, "machine_gpus", lambda: pytest.fail("a CPU pool must not count GPUs"))
    assert worker_device_env(["cpu", "cpu"]) == ({"CUDA_VISIBLE_DEVICES": ""}, ["cpu", "cpu"])
