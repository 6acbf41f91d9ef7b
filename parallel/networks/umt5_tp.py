"""Tensor parallelism for the umT5 text encoder: each rank holds ~1/tp of its matrices; runs in the workers.
Loading a shard (each rank reading only its slices) is ``weights/umt5_files.py``.

The model stays transformers' ``UMT5EncoderModel``; the Wan transformer's machinery (``TensorParallelPlan``,
the column / row linears, ``ShardedWeightSource``) is applied to it from outside. In every encoder layer:

* self-attention: ``q`` / ``k`` / ``v`` column-sharded by heads, ``o`` row-sharded with one all-reduce, and
  the layer's ``relative_attention_bias`` table (one column per head) split by columns; the attention
  module's ``n_heads`` / ``inner_dim`` become the local values, so transformers' forward runs unchanged;
* the feed-forward: ``wi_0`` / ``wi_1`` (or ``wi`` when not gated) column-sharded, ``wo`` row-sharded with
  one all-reduce.

The token embedding, the layer norms and the final norm stay replicated, so activations between layers
are replicated and every rank returns the same embeddings as one device.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from ..distributed.tensor_parallel import (
    COLUMN,
    HEAD_TABLE,
    ROW,
    TensorParallelPlan,
    check_tp_degree,
    shard_planned_modules_,
    tp_size_and_rank,
)

__all__ = ["apply_text_encoder_tp", "check_text_encoder_tp_degree", "text_encoder_tp_plan"]

UMT5_HEAD_ATTRIBUTES = ("n_heads", "inner_dim")


_FEED_FORWARD_STYLES = {"wi": COLUMN, "wi_0": COLUMN, "wi_1": COLUMN, "wo": ROW}


def check_text_encoder_tp_degree(config: UMT5Config, tp: int) -> None:
    """Fail, naming the numbers, when ``tp`` cannot split the encoder's heads and feed-forward width."""
    check_tp_degree(config.num_heads, config.d_ff, tp)


def _attention_styles(prefix: str, attention: nn.Module) -> dict[str, str]:
    styles = {f"{prefix}.{name}": COLUMN for name in ("q", "k", "v")}
    styles[f"{prefix}.o"] = ROW
    if attention.has_relative_attention_bias:
        styles[f"{prefix}.relative_attention_bias"] = HEAD_TABLE
    return styles


def _feed_forward_styles(prefix: str, feed_forward: nn.Module) -> dict[str, str]:
    return {f"{prefix}.{name}": style for name, style in _FEED_FORWARD_STYLES.items()
            if hasattr(feed_forward, name)}


def text_encoder_tp_plan(model: UMT5EncoderModel) -> TensorParallelPlan:
    """The plan for transformers' ``UMT5EncoderModel`` (parameter names as in its state dict)."""
    if not isinstance(model, UMT5EncoderModel):
        raise TypeError(f"{type(model).__name__} is not a UMT5EncoderModel")
    styles: dict[str, str] = {}
    attention_modules: list[str] = []
    for index, block in enumerate(model.encoder.block):
        attention_path = f"encoder.block.{index}.layer.0.SelfAttention"
        feed_forward_path = f"encoder.block.{index}.layer.1.DenseReluDense"
        styles.update(_attention_styles(attention_path, model.get_submodule(attention_path)))
        styles.update(_feed_forward_styles(feed_forward_path, model.get_submodule(feed_forward_path)))
        attention_modules.append(attention_path)
    return TensorParallelPlan(styles, tuple(attention_modules), UMT5_HEAD_ATTRIBUTES)


def apply_text_encoder_tp(model: UMT5EncoderModel, tp_group: dist.ProcessGroup | None) -> UMT5EncoderModel:
    """Shard an already-loaded full umT5 encoder over ``tp_group``, in place; one rank leaves it untouched."""
    tp, rank = tp_size_and_rank(tp_group)
    if tp == 1:
        return model
    check_text_encoder_tp_degree(model.config, tp)
    return shard_planned_modules_(model, text_encoder_tp_plan(model), rank, tp, tp_group)

