"""Sharded loading of Wan / VACE transformers for tensor parallelism: each rank reads only its slices;
runs in the workers.

The model is built on the meta device, the tensor-parallel plan swaps in the sharded modules (still meta,
with local shapes), and every parameter is then read from the checkpoint: sharded ones through
``WeightSource.read(..., index)`` / ``read_stored(..., index)``, which read just the rank's block from safetensors
(``get_slice``), a memory-mapped pickle or GGUF. Quantized block linears stay quantized (``weights="keep"``):
column-parallel ones take whole rows of the stored data, row-parallel ones block-aligned column ranges; a GGUF
tensor whose slice would cut its quant blocks is dequantized on that rank at load (logged once per model). No rank holds the full weights, on the host
or on the device: the weight memory of a rank is 1/tp of the sharded parameters plus the replicated ones.
Every accepted format (single files in the original layout, diffusers folders, VACE modules merged onto a
T2V base, fp8 and scaled fp8) goes through the same ``transformer_weight_source``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import TensorSlice, WeightSource, load_weights_into
from .quantized import StoredTensor, logical_name
from .loaders import build_transformer, transformer_weight_source
from ..networks.wan_inputs import with_native_inputs
from ..distributed.tensor_parallel import (
    TensorParallelPlan,
    check_tp_degree,
    shard_index,
    shard_modules_,
    tensor_parallel_plan,
    tp_size_and_rank,
)

__all__ = ["ShardedWeightSource", "load_transformer_shard", "load_transformer_tp", "weight_bytes"]


class ShardedWeightSource(WeightSource):
    """A weight source that answers with one rank's block of each sharded tensor, read as a slice."""

    def __init__(self, source: WeightSource, shard_dims: dict[str, int], rank: int, tp: int):
        super().__init__(source.refs, f"{source.description} (tensor-parallel shard {rank} of {tp})")
        self.shard_dims = dict(shard_dims)
        self.rank, self.tp = rank, tp

    def local_index(self, name: str) -> TensorSlice:
        dim = self.shard_dims.get(name)
        return None if dim is None else shard_index(super().shape(name), dim, self.rank, self.tp)

    def shape(self, name: str) -> tuple[int, ...]:
        full = super().shape(name)
        dim = self.shard_dims.get(name)
        return full if dim is None else full[:dim] + (full[dim] // self.tp,) + full[dim + 1:]

    def read(self, name: str, dtype: torch.dtype, index: TensorSlice = None) -> torch.Tensor:
        if index is not None:
            raise ValueError("a sharded weight source chooses the slice itself; read without an index")
        return super().read(name, dtype, self.local_index(name))

    def read_stored(self, name: str, index: TensorSlice = None) -> StoredTensor | None:
        if index is not None:
            raise ValueError("a sharded weight source chooses the slice itself; read without an index")
        return super().read_stored(name, self.local_index(name))

    def read_narrow(self, name: str, compute_dtype: torch.dtype, index: TensorSlice = None) -> StoredTensor | None:
        if index is not None:
            raise ValueError("a sharded weight source chooses the slice itself; read without an index")
        return super().read_narrow(name, compute_dtype, self.local_index(name))


def load_transformer_shard(
    path: str | Path,
    *,
    tp_rank: int,
    tp_size: int,
    tp_group: dist.ProcessGroup | None,
    vace_module: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "keep",
) -> nn.Module:
    """Rank ``tp_rank`` of ``tp_size``'s shard of a Wan / VACE transformer, its collectives on ``tp_group``.

    Loading needs no communication, so a shard can be loaded (and inspected) without a process group;
    its forward needs ``tp_group``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size - 1}] for tp_size={tp_size}, got {tp_rank}")
    with contextlib.ExitStack() as stack:
        model_class, config, source = transformer_weight_source(path, vace_module, stack)
        model = build_transformer(model_class, config)
        check_tp_degree(model.config.num_attention_heads, model.config.ffn_dim, tp_size)
        if tp_size > 1:
            plan = tensor_parallel_plan(model)
            shard_modules_(model, plan, tp_rank, tp_size, tp_group)
            source = ShardedWeightSource(source, plan.shard_dims(), tp_rank, tp_size)
        model = load_weights_into(model, source, dtype=dtype, device=device, keep_quantized=weights == "keep")
        return with_native_inputs(model)


def load_transformer_tp(
    path: str | Path,
    *,
    vace_module: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_group: dist.ProcessGroup | None = None,
    weights: str = "keep",
) -> nn.Module:
    """This rank's tensor-parallel shard of a Wan / VACE transformer over ``tp_group``, ready to run.

    Every rank of the group must call it. The forward takes the same arguments and returns the same
    (replicated) output on every rank. With one rank (or no process group) this is the full model.
    """
    tp_size, tp_rank = tp_size_and_rank(tp_group)
    return load_transformer_shard(path, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                  vace_module=vace_module, dtype=dtype, device=device, weights=weights)


def weight_bytes(model: nn.Module, plan: TensorParallelPlan | None = None) -> dict[str, int]:
    """Bytes of this rank's parameters: ``sharded`` (those the plan splits), ``replicated`` and ``total``.

    The plan is ``plan`` when given (a transformers model's own ``tp_plan`` is not ours), else the one a
    sharded Wan transformer records, else the Wan transformer plan. For a full model, ``sharded`` counts
    what the plan would split, so tp=1 compares like with like.
    """
    plan = plan or getattr(model, "tp_plan", None) or tensor_parallel_plan(model)
    sharded_names = set(plan.shard_dims())
    sharded = replicated = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if logical_name(name) in sharded_names:
            sharded += size
        else:
            replicated += size
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated}
