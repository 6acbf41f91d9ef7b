"""Context parallelism for diffusers' Wan and VACE transformers: the video sequence split over ranks.

Applied from outside the model, in the style of diffusers' ``_cp_plan`` for Wan, with this engine's own
hooks and attention kernels:

* ``rope``: its (cos, sin) tables are cut to this rank's slice of the (padded) sequence, so RoPE uses each
  rank's global positions. This hook also opens the per-forward :class:`SequenceShard`.
* ``blocks.0`` (and the first VACE block): the patch-embedded video tokens (and the VACE context tokens) are
  padded to a multiple of the degree and cut to this rank's slice before the first block runs.
* ``condition_embedder``: per-token timestep embeddings (Wan 2.2's per-frame timesteps, which diffusers takes as
  one timestep per token) are cut to this rank's slice too, so every block and the output modulation get the
  timesteps of the rank's own tokens; one timestep per row passes unchanged.
* ``attn1`` of every block and VACE block: a processor that attends this rank's queries over the whole
  sequence with ring, Ulysses or USP attention (``attention.py``); the padding is masked out of the keys.
  Cross-attention (``attn2``) stays local: the text tokens are replicated on every rank.
* ``proj_out``: the per-token head output is all-gathered over the sequence ranks and the padding cut,
  so the model returns the whole latent on every rank.

Sequence layout (USP): the rank with ring index ``i`` and Ulysses index ``j`` holds slice ``i * u + j``
of ``ring x ulysses`` equal slices. With tensor parallelism the same processor runs on the rank's heads
(``attn.heads`` is already the local count and q/k norms are distributed), so TP and CP compose.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .groups import all_gather_nested, optional_group_size_and_rank
from .attention import ring_attention, ulysses_attention
from ..config import check_head_split

__all__ = [
    "ContextParallel", "ContextParallelAttnProcessor", "SequenceShard", "apply_context_parallel",
    "check_ulysses_heads", "context_parallel_plan",
]


# --------------------------------------------------------------------------------------
# Per-forward sequence state
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceShard:
    """How one forward's sequence is split: ``valid_len`` real tokens padded to ``padded_len``, cut into
    ``count`` equal slices of which this rank holds slice ``index``."""

    valid_len: int
    index: int
    count: int

    @property
    def local_len(self) -> int:
        return -(-self.valid_len // self.count)

    @property
    def padded_len(self) -> int:
        return self.local_len * self.count

    def bounds(self) -> tuple[int, int]:
        """Where this rank's slice lies in the unpadded sequence (fewer than ``local_len`` at the end, possibly none)."""
        start = min(self.index * self.local_len, self.valid_len)
        return start, min(start + self.local_len, self.valid_len)

    def local_slice(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``full`` (the whole, unpadded sequence along ``dim``), zero-padded at the end."""
        if full.shape[dim] != self.valid_len:
            raise ValueError(
                f"expected the whole sequence of {self.valid_len} tokens along dim {dim}, got shape {tuple(full.shape)}"
            )
        start, stop = self.bounds()
        piece = full.narrow(dim, start, stop - start)
        missing = self.local_len - piece.shape[dim]
        if missing == 0:
            return piece
        pad_shape = list(piece.shape)
        pad_shape[dim] = missing
        return torch.cat([piece, piece.new_zeros(pad_shape)], dim=dim)


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallelPlan:
    """Module paths the hooks attach to; ``split_inputs`` maps a block to the arguments it splits."""

    rope: str
    split_inputs: dict[str, tuple[str, ...]]
    attention_modules: tuple[str, ...]
    gather: str
    timestep_embedding: str = "condition_embedder"  # its per-token outputs (temb, timestep_proj) are split


def context_parallel_plan(model: nn.Module) -> ContextParallelPlan:
    """The plan for a diffusers ``WanTransformer3DModel`` or ``WanVACETransformer3DModel``."""
    if not hasattr(model, "blocks") or not hasattr(model, "rope") or not hasattr(model, "proj_out"):
        raise TypeError(f"{type(model).__name__} is not a Wan transformer (it needs rope, blocks and proj_out)")
    # The VACE branch runs before blocks.0 and receives the whole video tokens; only VACE blocks with an
    # input projection read them, and only the first VACE block receives the whole context tokens (the
    # later ones get the previous VACE block's output, which is already this rank's slice).
    split_inputs: dict[str, tuple[str, ...]] = {}
    attention_modules = [f"blocks.{i}.attn1" for i in range(len(model.blocks))]
    for i, block in enumerate(getattr(model, "vace_blocks", ())):
        names = ("hidden_states",) if getattr(block, "proj_in", None) is not None else ()
        split_inputs[f"vace_blocks.{i}"] = names + (("control_hidden_states",) if i == 0 else ())
        attention_modules.append(f"vace_blocks.{i}.attn1")
    split_inputs["blocks.0"] = ("hidden_states",)
    return ContextParallelPlan("rope", split_inputs, tuple(attention_modules), "proj_out")


def check_ulysses_heads(num_heads: int, tp: int, ulysses: int) -> None:
    """Ulysses splits each tensor-parallel rank's heads again: tp x ulysses must divide the heads."""
    check_head_split(num_heads, tp=tp, ulysses=ulysses)


# --------------------------------------------------------------------------------------
# Rotary embedding and the attention processor
# --------------------------------------------------------------------------------------


def apply_wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on ``[B, S, H, D]`` with interleaved (cos, sin) tables ``[1, S, 1, D]``.

    diffusers keeps this as a closure inside ``WanAttnProcessor.__call__``, so it cannot be imported;
    written with the same operations so the numerics match.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class ContextParallelAttnProcessor:
    """Self-attention of a Wan block over a sequence split across ranks (replaces ``WanAttnProcessor``)."""

    def __init__(self, context: "ContextParallel"):
        self.context = context

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the context-parallel processor serves self-attention only (no context, no mask)")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = apply_wan_rotary(query, *rotary_emb), apply_wan_rotary(key, *rotary_emb)
        out = self.context.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


# --------------------------------------------------------------------------------------
# Groups, hooks and application
# --------------------------------------------------------------------------------------


class ContextParallel:
    """One rank's sequence-parallel setup for one model: groups, the current forward's shard, the hooks."""

    def __init__(self, ring_group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup | None):
        self.ring_size, self.ring_rank = optional_group_size_and_rank(ring_group)
        self.ulysses_size, self.ulysses_rank = optional_group_size_and_rank(ulysses_group)
        self.ring_group = ring_group if self.ring_size > 1 else None
        self.ulysses_group = ulysses_group if self.ulysses_size > 1 else None
        self.shard: SequenceShard | None = None
        self._handles: list[Any] = []
        self._replaced_processors: dict[str, Any] = {}

    @property
    def degree(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def slice_index(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def current_shard(self) -> SequenceShard:
        if self.shard is None:
            raise RuntimeError("no sequence shard is open: the model's rope must run before its blocks")
        return self.shard

    # -- attention -----------------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's attention output over the whole (unpadded) sequence; all inputs ``[B, s, H, D]``."""
        valid = self.current_shard().valid_len
        if self.ulysses_group is not None:
            return ulysses_attention(query, key, value, self.ulysses_group, valid_kv_len=valid, inner=self.ring_group)
        return ring_attention(query, key, value, self.ring_group, valid_kv_len=valid)

    # -- hooks ---------------------------------------------------------------------------------------

    def _open_shard_and_slice_rope(self, module, args, output):
        freqs_cos, freqs_sin = output
        self.shard = SequenceShard(valid_len=freqs_cos.shape[1], index=self.slice_index, count=self.degree)
        return self.shard.local_slice(freqs_cos), self.shard.local_slice(freqs_sin)

    def _split_hook(self, module: nn.Module, names: tuple[str, ...]):
        signature = inspect.signature(module.forward)  # blocks are called positionally; bind finds the names

        def split_arguments(module, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            for name in names:
                bound.arguments[name] = self.current_shard().local_slice(bound.arguments[name])
            return bound.args, bound.kwargs

        return split_arguments

    def _split_token_embeddings(self, module, args, output: tuple) -> tuple:
        """diffusers' condition embedder returns (temb, timestep_proj, text, image); with one timestep per token
        temb is [B, tokens, dim] and timestep_proj [B, tokens, 6 * dim]: keep this rank's tokens."""
        temb, timestep_proj, *rest = output
        if temb.ndim != 3:
            return output
        shard = self.current_shard()
        return (shard.local_slice(temb), shard.local_slice(timestep_proj), *rest)

    def _gather_output(self, module, args, output: torch.Tensor) -> torch.Tensor:
        shard = self.current_shard()
        # Ulysses first: its ranks hold neighbouring slices (i * u + j), then whole ring chunks.
        gathered = all_gather_nested(output, [self.ulysses_group, self.ring_group], dim=1)
        self.shard = None
        return gathered[:, : shard.valid_len]

    def install(self, model: nn.Module, plan: ContextParallelPlan) -> None:
        submodule = model.get_submodule
        self._handles.append(submodule(plan.rope).register_forward_hook(self._open_shard_and_slice_rope))
        self._handles.append(submodule(plan.timestep_embedding).register_forward_hook(self._split_token_embeddings))
        for path, names in plan.split_inputs.items():
            if names:
                hook = self._split_hook(submodule(path), names)
                self._handles.append(submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
        processor = ContextParallelAttnProcessor(self)
        for path in plan.attention_modules:
            self._replaced_processors[path] = submodule(path).processor
            submodule(path).set_processor(processor)
        self._handles.append(submodule(plan.gather).register_forward_hook(self._gather_output))

    def remove(self, model: nn.Module) -> None:
        """Undo ``install``: the model runs on one rank's full sequence again."""
        for handle in self._handles:
            handle.remove()
        for path, processor in self._replaced_processors.items():
            model.get_submodule(path).set_processor(processor)
        self._handles.clear()
        self._replaced_processors.clear()
        self.shard = None


def apply_context_parallel(
    model: nn.Module, *, ring_group: dist.ProcessGroup | None = None, ulysses_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Split the sequence of a loaded (optionally tensor-parallel) Wan / VACE model over ring x ulysses ranks.

    In place; returns the model. Every rank of both groups must call it and then run every forward
    together. Groups of one rank (or ``None``) leave the model untouched. The model keeps its single-device
    signature and returns the whole output on every rank.
    """
    context = ContextParallel(ring_group, ulysses_group)
    if context.degree == 1:
        return model
    tp = getattr(model, "tp_size", 1)
    check_ulysses_heads(model.config.num_attention_heads, tp, context.ulysses_size)
    if getattr(model, "context_parallel", None) is not None:
        raise RuntimeError("context parallelism is already applied to this model")
    context.install(model, context_parallel_plan(model))
    model.context_parallel = context
    return model
