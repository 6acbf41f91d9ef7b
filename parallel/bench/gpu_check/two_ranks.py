"""The GPU check's two-rank section: two ranks spawned on one device (NCCL if it accepts two ranks on one GPU, else
gloo over device tensors) run tp 2 and ulysses 2, each against world 1."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .harness import (
    PARALLEL_TOLERANCE,
    Run,
    forward_on,
    model_inputs,
    no_tf32,
    relative_error,
    result_row,
    verdict,
    write_transformer,
)


def spawn_pair(function: Callable, args: tuple, backend: str, device: torch.device, deadline_s: float) -> None:
    """``function(rank, device, *args)`` on two ranks that share ``device``, killed at the deadline."""
    from ...distributed.spawn import spawn_ranks

    spawn_ranks(_on_shared_device, 2, args=(function, str(device), args), device=str(device), deadline_s=deadline_s,
                pg_timeout_s=120.0, backend=backend)


def _on_shared_device(rank: int, world: int, function: Callable, device: str, args: tuple) -> None:
    function(rank, torch.device(device), *args)


def _nccl_probe(rank: int, device: torch.device) -> None:
    import torch.distributed as dist

    value = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(value)
    torch.cuda.synchronize(device)
    if not torch.all(value == 3):
        raise RuntimeError(f"NCCL all-reduce on one device gave {value.tolist()}")


def _two_rank_main(rank: int, device: torch.device, model_path: str, inputs_path: str, folder: str) -> None:
    """tp 2, then ulysses 2, each one forward in fp32 (TF32 off); rank 0 writes the outputs."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from ...distributed.context_parallel import apply_context_parallel
    from ...tensor_files import save_tensors_atomic
    from ...weights.loaders import load_transformer
    from ...weights.sharded import load_transformer_tp

    inputs = load_file(inputs_path)
    outputs, errors = {}, {}
    loaders = {"tp 2": lambda: load_transformer_tp(model_path, dtype=torch.float32, device=device,
                                                   tp_group=dist.group.WORLD),
               "ulysses 2": lambda: apply_context_parallel(
                   load_transformer(model_path, dtype=torch.float32, device=device), ulysses_group=dist.group.WORLD)}
    for name, load in loaders.items():
        try:
            with no_tf32():
                outputs[name] = forward_on(load(), inputs, device, torch.float32)
        except Exception as error:  # noqa: BLE001 - reported; the other layout still runs
            errors[name] = f"{type(error).__name__}: {str(error).strip()[:300]}"
    if rank == 0:
        save_tensors_atomic(outputs, Path(folder, "outputs.safetensors"))
        Path(folder, "errors.json").write_text(json.dumps(errors))


def check_two_ranks(run: Run) -> dict:
    from safetensors.torch import load_file

    from ...tensor_files import save_tensors_atomic
    from ...weights.loaders import load_transformer

    path = str(write_transformer(run, "tiny")["model"])
    world1 = load_transformer(path, dtype=torch.float32, device=run.device)
    inputs = model_inputs(world1.config, run.sizes.check_latent)
    with no_tf32():
        reference = forward_on(world1, inputs, run.device, torch.float32)
    del world1
    backend, nccl_error = "gloo", None
    if run.device.type == "cuda":
        try:
            spawn_pair(_nccl_probe, (), "nccl", run.device, deadline_s=min(60.0, run.remaining() / 3))
            backend = "nccl"
        except Exception as error:  # noqa: BLE001 - NCCL refusing two ranks on one GPU: gloo instead
            lines = str(error).strip().splitlines()
            nccl_error = f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
    with tempfile.TemporaryDirectory() as folder:
        inputs_path = save_tensors_atomic(inputs, Path(folder, "inputs.safetensors"))
        spawn_pair(_two_rank_main, (path, str(inputs_path), folder), backend, run.device,
                   deadline_s=max(run.remaining() - 5, 10))
        outputs = load_file(Path(folder, "outputs.safetensors"))
        errors = json.loads(Path(folder, "errors.json").read_text())
    rows = [result_row(f"{name} ({backend}) vs world 1", relative_error(outputs[name], reference), PARALLEL_TOLERANCE)
            for name in ("tp 2", "ulysses 2") if name in outputs]
    result = verdict(rows)
    if errors:
        result["status"] = "fail"
    return {**result, "backend": backend, "nccl_on_one_device": backend == "nccl", "nccl_error": nccl_error,
            "errors": errors}
