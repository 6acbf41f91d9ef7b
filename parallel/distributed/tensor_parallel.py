"""Megatron-style tensor parallelism for diffusers' Wan and VACE transformers, applied from outside the model.

The model classes stay single-device code. A plan names, for every transformer block and every VACE block,
which modules are split over the ranks of a tensor-parallel group:

* self- and cross-attention: ``to_q`` / ``to_k`` / ``to_v`` column-sharded by heads (rank ``r`` holds heads
  ``r*H/tp .. (r+1)*H/tp``), ``to_out.0`` row-sharded with one all-reduce;
* Wan's q/k RMSNorm spans the whole inner dim (all heads): it becomes a distributed RMSNorm whose sum of
  squares is all-reduced, so every rank normalises its heads exactly as the full norm would;
* the FFN: ``ffn.net.0.proj`` column-sharded, ``ffn.net.2`` row-sharded with one all-reduce.

Embeddings (the Fun Camera adapter with the patch embedding), modulation tables, norms, the head and the VACE
``proj_in`` / ``proj_out`` stay replicated.
The same plans and modules shard transformers' umT5 text encoder (see ``text_encoder_tp``), whose per-layer
relative position bias table has one column per head and splits by columns (the ``head_table`` style).
Each attention module's ``heads`` becomes the local head count, so diffusers' own ``WanAttnProcessor`` (and
any processor that unflattens with ``attn.heads``) runs unchanged. Activations between blocks are
replicated: the sharded model takes the same arguments and returns the same output on every rank.

Plain sharded ``nn.Linear`` modules plus ``torch.distributed.all_reduce`` are used rather than PyTorch's
DTensor tensor-parallel API (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``): the
API has no style for an RMSNorm over sharded features, so a hand-written norm on local tensors is needed
anyway; plain tensors keep diffusers' processors and the context-parallel attention free of DTensor
dispatch on every op; the sharded loader can fill local shards directly; and ``dist.all_reduce`` is what
``CollectiveCounter`` counts (DTensor issues functional collectives it cannot see).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..config import check_head_split
from .groups import group_size_and_rank

__all__ = [
    "ColumnParallelLinear", "DistributedRMSNorm", "RowParallelLinear", "TensorParallelPlan",
    "analytic_collectives", "apply_tensor_parallel", "check_tp_degree", "shard_index", "shard_modules_",
    "shard_planned_modules_",
    "tensor_parallel_plan", "tp_size_and_rank",
]

COLUMN, ROW, NORM, HEAD_TABLE = "column", "row", "norm", "head_table"
# Which dimension of each parameter a style splits; parameters not listed (a row linear's bias) are replicated.
# A head table is an nn.Embedding with one column per attention head (T5's relative position bias).
_SHARD_DIMS = {COLUMN: {"weight": 0, "bias": 0}, ROW: {"weight": 1}, NORM: {"weight": 0}, HEAD_TABLE: {"weight": 1}}
DIFFUSERS_HEAD_ATTRIBUTES = ("heads", "inner_dim", "kv_inner_dim")


# --------------------------------------------------------------------------------------
# Groups and validation
# --------------------------------------------------------------------------------------


def tp_size_and_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(degree, this rank's index) of a tensor-parallel group; (1, 0) without torch.distributed."""
    return group_size_and_rank(tp_group)


def check_tp_degree(num_heads: int, ffn_dim: int, tp: int) -> None:
    """Fail, naming the numbers, when ``tp`` cannot split the heads and the FFN evenly."""
    check_head_split(num_heads, tp=tp, ffn_dim=ffn_dim)


def shard_index(shape: tuple[int, ...] | torch.Size, dim: int, rank: int, tp: int) -> tuple[slice, ...]:
    """The index of rank ``rank``'s contiguous 1/tp block of a tensor of ``shape`` along ``dim``."""
    size = shape[dim]
    if size % tp:
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(shape)} does not split into {tp} equal parts")
    block = size // tp
    return (slice(None),) * dim + (slice(rank * block, (rank + 1) * block),)


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallelPlan:
    """Module path -> style (``column``, ``row``, ``norm`` or ``head_table``), plus the attention modules whose
    heads split and the attributes of those modules that count heads (divided by tp when sharding)."""

    styles: dict[str, str] = field(default_factory=dict)
    attention_modules: tuple[str, ...] = ()
    head_attributes: tuple[str, ...] = DIFFUSERS_HEAD_ATTRIBUTES

    def shard_dims(self) -> dict[str, int]:
        """{parameter name: dimension split over the ranks}; every other parameter is replicated."""
        return {f"{path}.{param}": dim for path, style in self.styles.items()
                for param, dim in _SHARD_DIMS[style].items()}


def _attention_styles(prefix: str, attention: nn.Module) -> dict[str, str]:
    styles = {f"{prefix}.to_q": COLUMN, f"{prefix}.to_k": COLUMN, f"{prefix}.to_v": COLUMN, f"{prefix}.to_out.0": ROW}
    if getattr(attention, "add_k_proj", None) is not None:  # image cross-attention (I2V), split like text
        styles.update({f"{prefix}.add_k_proj": COLUMN, f"{prefix}.add_v_proj": COLUMN})
    for norm_name in ("norm_q", "norm_k", "norm_added_k"):
        norm = getattr(attention, norm_name, None)
        if isinstance(norm, nn.RMSNorm) and norm.weight is not None:
            styles[f"{prefix}.{norm_name}"] = NORM
        elif norm is not None and not isinstance(norm, nn.Identity):
            raise TypeError(f"{prefix}.{norm_name} is a {type(norm).__name__}; tensor parallelism supports an "
                            f"RMSNorm with weights over all heads (Wan's qk_norm) or no q/k norm")
    return styles


def _block_styles(prefix: str, block: nn.Module) -> dict[str, str]:
    styles = {}
    for attention_name in ("attn1", "attn2"):
        styles.update(_attention_styles(f"{prefix}.{attention_name}", getattr(block, attention_name)))
    styles.update({f"{prefix}.ffn.net.0.proj": COLUMN, f"{prefix}.ffn.net.2": ROW})
    return styles


def _parallel_blocks(model: nn.Module) -> list[str]:
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    return names + [f"vace_blocks.{i}" for i in range(len(getattr(model, "vace_blocks", ())))]


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """The plan for a diffusers ``WanTransformer3DModel`` or ``WanVACETransformer3DModel``."""
    if not hasattr(model, "blocks"):
        raise TypeError(f"{type(model).__name__} is not a Wan transformer (it has no .blocks)")
    styles: dict[str, str] = {}
    attention_modules: list[str] = []
    for prefix in _parallel_blocks(model):
        styles.update(_block_styles(prefix, model.get_submodule(prefix)))
        attention_modules += [f"{prefix}.attn1", f"{prefix}.attn2"]
    return TensorParallelPlan(styles, tuple(attention_modules))


def _model_dims(model: nn.Module) -> tuple[int, int]:
    config = model.config
    return config.num_attention_heads, config.ffn_dim


# --------------------------------------------------------------------------------------
# Sharded modules
# --------------------------------------------------------------------------------------


def _local_copy(tensor: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
    # A private contiguous copy, so the full tensor's storage is not kept alive by a view.
    return tensor.detach()[index].clone(memory_format=torch.contiguous_format)


class ColumnParallelLinear(nn.Linear):
    """A linear layer holding a 1/tp block of the output features: replicated input, sharded output, no
    communication. Only a marker class: the forward is nn.Linear's."""

    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, tp: int) -> ColumnParallelLinear:
        weight_index = shard_index(linear.weight.shape, 0, rank, tp)
        sharded = cls(linear.in_features, linear.out_features // tp, bias=linear.bias is not None,
                      device="meta", dtype=linear.weight.dtype)
        sharded.weight = nn.Parameter(_local_copy(linear.weight, weight_index), requires_grad=False)
        if linear.bias is not None:
            sharded.bias = nn.Parameter(_local_copy(linear.bias, weight_index[:1]), requires_grad=False)
        sharded.tp_rank, sharded.tp_size = rank, tp
        return sharded

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"


class RowParallelLinear(nn.Module):
    """A linear layer holding a 1/tp block of the input features: sharded input, replicated output.

    The partial products are summed with one all-reduce; the bias is added once, after it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, tp: int, group) -> RowParallelLinear:
        weight = _local_copy(linear.weight, shard_index(linear.weight.shape, 1, rank, tp))
        bias = None if linear.bias is None else _local_copy(linear.bias, (slice(None),))
        return cls(weight, bias, group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = F.linear(hidden_states, self.weight)
        dist.all_reduce(output, group=self.group)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in_features_local={in_features}, out_features={out_features}, bias={self.bias is not None}"


class DistributedRMSNorm(nn.Module):
    """RMSNorm over features split across a group: the sum of squares is all-reduced, the result equals the
    full norm's slice. Follows torch.rms_norm's numerics: computed in float32, cast back, then scaled."""

    def __init__(self, weight: torch.Tensor, full_features: int, eps: float, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.full_features = full_features
        self.eps = eps
        self.group = group

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm, rank: int, tp: int, group) -> DistributedRMSNorm:
        (features,) = norm.normalized_shape
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        weight = _local_copy(norm.weight, shard_index(norm.weight.shape, 0, rank, tp))
        return cls(weight, features, eps, group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        upcast = hidden_states.float()
        sum_of_squares = upcast.pow(2).sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_of_squares, group=self.group)
        normalised = upcast * torch.rsqrt(sum_of_squares / self.full_features + self.eps)
        return normalised.type_as(hidden_states) * self.weight

    def extra_repr(self) -> str:
        return f"local_features={self.weight.shape[0]}, full_features={self.full_features}, eps={self.eps}"


def _sharded_head_table(table: nn.Embedding, rank: int, tp: int) -> nn.Embedding:
    """An embedding holding rank ``rank``'s block of columns (heads); no communication."""
    weight = _local_copy(table.weight, shard_index(table.weight.shape, 1, rank, tp))
    sharded = nn.Embedding(table.num_embeddings, table.embedding_dim // tp, device="meta", dtype=weight.dtype)
    sharded.weight = nn.Parameter(weight, requires_grad=False)
    return sharded


def _replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def _sharded_module(module: nn.Module, style: str, rank: int, tp: int, group) -> nn.Module:
    if style == COLUMN:
        return ColumnParallelLinear.from_linear(module, rank, tp)
    if style == ROW:
        return RowParallelLinear.from_linear(module, rank, tp, group)
    if style == HEAD_TABLE:
        return _sharded_head_table(module, rank, tp)
    return DistributedRMSNorm.from_rms_norm(module, rank, tp, group)


def shard_planned_modules_(model: nn.Module, plan: TensorParallelPlan, rank: int, tp: int, group) -> nn.Module:
    """Swap the planned modules for rank ``rank``'s shards and divide the head counts, in place (meta
    parameters stay meta). Records nothing on the model (transformers' models own ``tp_size`` / ``tp_plan``)."""
    for path, style in plan.styles.items():
        _replace_module(model, path, _sharded_module(model.get_submodule(path), style, rank, tp, group))
    for path in plan.attention_modules:
        attention = model.get_submodule(path)
        for attribute in plan.head_attributes:
            setattr(attention, attribute, getattr(attention, attribute) // tp)
    return model


def shard_modules_(model: nn.Module, plan: TensorParallelPlan, rank: int, tp: int, group) -> nn.Module:
    """``shard_planned_modules_`` for a diffusers model, recording ``tp_size``, ``tp_rank`` and ``tp_plan`` on it."""
    shard_planned_modules_(model, plan, rank, tp, group)
    model.tp_size, model.tp_rank, model.tp_plan = tp, rank, plan
    return model


def apply_tensor_parallel(model: nn.Module, tp_group: dist.ProcessGroup | None) -> nn.Module:
    """Shard an already-loaded full Wan / VACE transformer over ``tp_group``, in place; returns it.

    A group of one rank (or no process group) leaves the model untouched.
    """
    tp, rank = tp_size_and_rank(tp_group)
    if tp == 1:
        return model
    check_tp_degree(*_model_dims(model), tp)
    return shard_modules_(model, tensor_parallel_plan(model), rank, tp, tp_group)


# --------------------------------------------------------------------------------------
# Analytic communication count
# --------------------------------------------------------------------------------------


def analytic_collectives(
    *, num_blocks: int, batch: int, video_tokens: int, text_tokens: int, dim: int, tp: int,
    activation_bytes: int,
) -> dict[str, int]:
    """All-reduce calls and bytes one rank sends in one forward of the sharded model.

    Per block: three all-reduces of the ``[batch, video_tokens, dim]`` activations (self-attention out,
    cross-attention out, FFN out) and four float32 sum-of-squares all-reduces for the q/k norms (self q and
    k over the video tokens, cross q over the video tokens and cross k over the text tokens). Bytes follow
    CollectiveCounter's convention: a ring all-reduce sends 2 (tp - 1) / tp of the tensor per rank.
    """
    if tp == 1:
        return {"calls": 0, "payload_bytes": 0, "sent_bytes": 0}
    activations = 3 * batch * video_tokens * dim * activation_bytes
    norm_statistics = batch * (3 * video_tokens + text_tokens) * 4
    per_block_sent = (3 * (2 * (tp - 1) * (batch * video_tokens * dim * activation_bytes) // tp)
                      + 3 * (2 * (tp - 1) * (batch * video_tokens * 4) // tp)
                      + 2 * (tp - 1) * (batch * text_tokens * 4) // tp)
    return {"calls": 7 * num_blocks, "payload_bytes": num_blocks * (activations + norm_statistics),
            "sent_bytes": num_blocks * per_block_sent}
