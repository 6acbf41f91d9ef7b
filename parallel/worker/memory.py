"""How much memory a rank's resident models may take, and how much they take; runs in a worker process.

The budget per rank is ``ParallelConfig.memory_budget_gb`` when set, else what the device can hold: the GPU's
whole memory (free + used, as CUDA reports it) less a tenth for activations, or on the CPU half the
machine's RAM shared by the ranks on it. Sizes are counted from the tensors themselves (parameters and
buffers), so every rank of an even split counts the same and makes the same unload decisions.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GPU_WEIGHT_SHARE = 0.9  # the rest is left for activations, the VAE's work buffers and the CUDA context
CPU_RAM_SHARE = 0.5  # of the machine's RAM, for all CPU ranks together
GB = 1e9


def machine_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget_bytes(budget_gb: float, device: torch.device, ranks_on_machine: int = 1) -> int:
    """The budget of one rank: ``budget_gb`` when above 0, else what ``device`` can hold (see the module)."""
    if budget_gb and budget_gb > 0:
        return int(budget_gb * GB)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * GPU_WEIGHT_SHARE)
    return int(machine_ram_bytes() * CPU_RAM_SHARE / max(1, ranks_on_machine))


def resident_bytes(model: object) -> int:
    """Bytes of the storages behind the tensors a loaded model holds: its own parameters and buffers (a quantized
    layer's stored tensor included), or those of the modules it wraps (a text encoder with its tokenizer, a VAE
    wrapper); each storage counts once, however many tensors view it. A model whose blocks stream from host memory
    (``block_streaming.py``) counts what it holds on its device at most."""
    streamer = getattr(model, "block_streamer", None)
    if streamer is not None:
        return streamer.device_bytes
    storages: dict[tuple[torch.device, int], int] = {}
    for module in _modules_of(model):
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _modules_of(model: object) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    return [value for value in vars(model).values() if isinstance(value, torch.nn.Module)] if hasattr(model, "__dict__") else []


def estimated_load_bytes(paths: tuple[str | None, ...], shards: int = 1) -> int:
    """Bytes a load will add before it happens: the weight files' size, split over tensor-parallel shards
    (a dtype change makes it approximate; the size actually resident is counted after the load)."""
    total = 0
    for path in (Path(p) for p in paths if p):
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    return total // max(1, shards)


def return_freed_heap() -> None:
    """Hand the heap that freed tensors (unloaded weights, a finished request's work) leave behind back to the
    system: glibc keeps freed memory in its arenas (the process's resident size would stay near its highest) until
    ``malloc_trim`` releases it. No-op where the C library has no ``malloc_trim`` (musl, macOS)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
