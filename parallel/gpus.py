"""Which GPUs the local pool's ``cuda:N`` devices name, and the device list each worker is started with.
Runs in the driver (the ComfyUI or CLI process).

A host process is often narrowed to one GPU: ComfyUI's ``--cuda-device 1`` sets ``CUDA_VISIBLE_DEVICES=1``
in its own environment before anything else runs. Workers that inherited that variable would all see one
GPU, whatever the pool asked for. So the pool's ``cuda:N`` are the machine's GPUs as ``nvidia-smi`` numbers
them (PCI bus order), and every worker is started with its device list set explicitly: the GPUs of the pool,
in PCI bus order, each rank using its own entry of that list.

Counting asks ``nvidia-smi -L`` (the NVIDIA driver's tool; torch only counts what the host's variable lets it
see). Without ``nvidia-smi`` the host's own view is all there is: ``cuda:N`` is then the N-th GPU the host
sees (the N-th entry of its ``CUDA_VISIBLE_DEVICES`` when set); so it is with a torch built without CUDA.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
from dataclasses import dataclass

NVIDIA_SMI_TIMEOUT_S = 10.0
GPU_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)

log = logging.getLogger("wanmesh")


@dataclass(frozen=True)
class MachineGpus:
    """The GPU ids the pool's ``cuda:0``, ``cuda:1``, ... stand for (as ``CUDA_VISIBLE_DEVICES`` entries), and
    where that list came from (for messages)."""

    ids: tuple[str, ...]
    source: str

    @property
    def count(self) -> int:
        return len(self.ids)


def _nvidia_smi_ids() -> tuple[str, ...] | None:
    """The machine's GPU indices from ``nvidia-smi -L``; None when the tool is missing or fails."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                                 env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listing.returncode != 0:
        return None
    return tuple(GPU_LINE.findall(listing.stdout))


def _host_visible_ids() -> tuple[str, ...]:
    """The GPUs this process sees, as entries usable in a worker's ``CUDA_VISIBLE_DEVICES``."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if narrowed is not None:
        entries = [entry.strip() for entry in narrowed.split(",") if entry.strip()]
        return tuple(entries[:count])
    return tuple(str(index) for index in range(count))


@functools.lru_cache(maxsize=1)
def machine_gpus() -> MachineGpus:
    """The GPUs the local pool may use (asked once per process: GPUs do not come and go)."""
    import torch

    # A torch built without CUDA cannot use what nvidia-smi lists: only the host's own view counts then.
    ids = _nvidia_smi_ids() if torch.version.cuda is not None else None
    if ids is not None:
        gpus = MachineGpus(ids, "nvidia-smi")
    else:
        gpus = MachineGpus(_host_visible_ids(), "this process's CUDA view (no nvidia-smi)")
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if narrowed is not None and gpus.source == "nvidia-smi" and gpus.count:
        log.info("WanMesh: this process sees GPUs %r (CUDA_VISIBLE_DEVICES); the pool's cuda:N are the machine's "
                 "%d GPUs as nvidia-smi numbers them", narrowed, gpus.count)
    return gpus


def worker_device_env(rank_devices: list[str], gpus: MachineGpus | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment every worker gets (its GPU list set explicitly, never inherited: empty for a CPU pool)
    and each rank's device inside that list. ``rank_devices`` are the pool's devices (``cpu`` or ``cuda:N``, N
    a machine index); ``gpus``: the machine's (default: ``machine_gpus()``, asked only for a GPU pool)."""
    pool_gpus = sorted({int(device.split(":")[1]) for device in rank_devices if device.startswith("cuda:")})
    if not pool_gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}, list(rank_devices)
    gpus = gpus or machine_gpus()
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus.ids[index] for index in pool_gpus)}
    if gpus.source == "nvidia-smi":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's own default order may differ from nvidia-smi's
    local = {index: position for position, index in enumerate(pool_gpus)}
    worker_devices = [f"cuda:{local[int(d.split(':')[1])]}" if d.startswith("cuda:") else d for d in rank_devices]
    return env, worker_devices
