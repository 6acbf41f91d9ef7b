"""Sequence-parallel causal attention for streaming: a chunk's tokens split over the Ulysses ranks; runs in the
workers.

Plugged into ``models/causal.py``'s :class:`CausalWan` as its attention strategy:

* positions: each rank holds 1/P of the chunk's tokens (``SequenceShard``: padded to a multiple of P, rank
  ``r`` holds slice ``r``) and applies RoPE locally from its tokens' global indices - its rows of the one
  precomputed table (global token = rank offset + local index; time = start frame + token // (h*w)); no
  communication for positions;
* ONE all-to-all on q, k and v stacked together switches from sequence to head sharding; the rank attends, for
  its own heads, over its KV cache (which therefore holds only its heads: 1/P of the cache per rank) plus the
  whole chunk; one all-to-all switches back. Tensor parallelism composes: the model's ``attn.heads`` is already
  the tp rank's share, split again over the Ulysses ranks;
* ``fused_all_to_all=False`` is the baseline it is compared with: three all-gathers of q, k and v (each rank then
  keeps its heads) and an all-gather of the output (each rank keeps its tokens);
* the model's output head is all-gathered over the ranks (after ``proj_out``; after ``norm_out`` for the uncached
  reference, whose per-token timestep modulation spans the whole sequence), so every rank returns the whole chunk.

On CPU (gloo) ``all_to_all_single`` runs as gloo's alltoall; :func:`exchange_bytes_per_chunk` gives the bytes the
benchmark reports beside the times.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import check_head_split
from ..networks.causal import BlockKVCache, masked_attention
from .attention import _heads_to_sequence, _sequence_to_heads, attention
from .context_parallel import SequenceShard
from .groups import group_size_and_rank

__all__ = ["CausalSequencePlan", "UlyssesCausalAttention", "causal_sequence_plan", "exchange_bytes_per_chunk"]


@dataclass(frozen=True)
class CausalSequencePlan:
    """Where the causal sequence split hooks in, as data beside ``context_parallel.ContextParallelPlan``: the
    first of ``blocks`` takes the chunk's tokens and splits them; every block splits a per-token modulation;
    the output is gathered after ``gather_per_token`` (per-token timesteps, whose modulation spans the whole
    sequence) or after ``gather``."""

    blocks: tuple[str, ...]
    gather_per_token: str
    gather: str


def causal_sequence_plan(model: nn.Module) -> CausalSequencePlan:
    """The plan for a diffusers Wan transformer run causally (``models/causal.py``)."""
    if not hasattr(model, "blocks") or not hasattr(model, "norm_out") or not hasattr(model, "proj_out"):
        raise TypeError(f"{type(model).__name__} is not a Wan transformer (it needs blocks, norm_out and proj_out)")
    return CausalSequencePlan(tuple(f"blocks.{i}" for i in range(len(model.blocks))), "norm_out", "proj_out")


class UlyssesCausalAttention:
    """The causal attention strategy for a chunk split over ``group`` (the pool's Ulysses ranks)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, *, fused_all_to_all: bool = True):
        self.group = group
        self.degree, self.rank = group_size_and_rank(group)
        check_head_split(model.config.num_attention_heads, tp=getattr(model, "tp_size", 1), ulysses=self.degree)
        self.fused = fused_all_to_all
        self.shard: SequenceShard | None = None
        self.per_token = False

    # -- sequence split (hooks) ----------------------------------------------------------------------

    def rope(self, rope: tuple[torch.Tensor, torch.Tensor], per_token: bool = False):
        """Opens this forward's shard and returns this rank's rows of the chunk's RoPE table."""
        cos, sin = rope
        self.shard = SequenceShard(valid_len=cos.shape[1], index=self.rank, count=self.degree)
        self.per_token = per_token
        return self.shard.local_slice(cos), self.shard.local_slice(sin)

    def install(self, model: nn.Module) -> list:
        plan = causal_sequence_plan(model)
        handles = [model.get_submodule(plan.gather_per_token).register_forward_hook(self._gather_if(per_token=True)),
                   model.get_submodule(plan.gather).register_forward_hook(self._gather_if(per_token=False))]
        for path in plan.blocks:
            block = model.get_submodule(path)
            hook = self._split_block_inputs(block, first=path == plan.blocks[0])
            handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
        return handles

    def _split_block_inputs(self, block: nn.Module, first: bool):
        signature = inspect.signature(block.forward)

        def split(module, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            if first:
                bound.arguments["hidden_states"] = self.shard.local_slice(bound.arguments["hidden_states"])
            if self.per_token:  # per-token modulation [B, S, 6, dim] follows the tokens
                bound.arguments["temb"] = self.shard.local_slice(bound.arguments["temb"])
            return bound.args, bound.kwargs

        return split

    def _gather_if(self, per_token: bool):
        def gather(module, args, output):
            if self.per_token != per_token:
                return output
            return self._all_gather(output.contiguous(), dim=1)[:, : self.shard.valid_len]

        return gather

    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        pieces = [torch.empty_like(tensor) for _ in range(self.degree)]
        dist.all_gather(pieces, tensor, group=self.group)
        return torch.cat(pieces, dim=dim)

    # -- head exchange --------------------------------------------------------------------------------

    def _to_heads(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, s, H, D] sequence slices -> [B, P*s, H/P, D] head slices of the whole (padded) chunk."""
        if self.fused:
            return tuple(_sequence_to_heads(torch.stack((q, k, v)), self.group, self.degree))
        heads = q.shape[2] // self.degree
        mine = slice(self.rank * heads, (self.rank + 1) * heads)
        return tuple(self._all_gather(x.contiguous(), dim=1)[:, :, mine] for x in (q, k, v))

    def _to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """[B, P*s, H/P, D] -> this rank's [B, s, H, D]."""
        if self.fused:
            return _heads_to_sequence(out, self.group, self.degree)
        local = self.shard.local_len
        everything = self._all_gather(out.contiguous(), dim=2)
        return everything[:, self.rank * local : (self.rank + 1) * local]

    def attend(self, cache: BlockKVCache, q, k, v, frames: list[int]) -> torch.Tensor:
        q, k, v = self._to_heads(q, k, v)
        valid = self.shard.valid_len
        keys, values = cache.with_chunk(k[:, :valid], v[:, :valid], frames)
        return self._to_sequence(attention(q, keys, values))

    def attend_masked(self, mask: torch.Tensor, q, k, v) -> torch.Tensor:
        q, k, v = self._to_heads(q, k, v)
        valid = self.shard.valid_len
        padded_rows = mask.new_ones(q.shape[1] - valid, valid)  # padding queries: any finite row, dropped later
        out = masked_attention(torch.cat([mask, padded_rows]), q, k[:, :valid], v[:, :valid])
        return self._to_sequence(out)


def exchange_bytes_per_chunk(*, tokens: int, heads: int, head_dim: int, blocks: int, degree: int, batch: int = 1,
                             element_bytes: int = 4, fused: bool = True) -> dict[str, int]:
    """Bytes one rank sends per forward of a chunk in the attention exchanges (not the output gather).

    Fused: the all-to-all of stacked q/k/v and the one back keep (P-1)/P of each tensor off-rank. Three gathers:
    each rank sends its whole slice of q, k and v to P-1 peers, and the output gather does the same."""
    local = -(-tokens // degree)
    slice_bytes = batch * local * heads * head_dim * element_bytes
    if fused:
        per_forward = 3 * slice_bytes * (degree - 1) // degree + slice_bytes * (degree - 1) // degree
        calls = 2
    else:
        per_forward = 4 * slice_bytes * (degree - 1)
        calls = 4
    return {"bytes": per_forward * blocks, "calls": calls * blocks}
