"""umT5 text encoder files: a ComfyUI single file (its SentencePiece model inside as the ``spiece_model`` tensor) or a
transformers / diffusers folder, read into the text encoder of ``networks/umt5.py``, whole or as this rank's
tensor-parallel shard (``networks/umt5_tp.py``'s plan, each rank reading only its slices); runs in the workers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import sentencepiece
import torch
import torch.distributed as dist
from transformers import UMT5Config, UMT5EncoderModel

from ..distributed.tensor_parallel import shard_planned_modules_, tp_size_and_rank
from ..networks.umt5 import EOS_ID, PAD_ID, TextEncoder
from ..networks.umt5_tp import check_text_encoder_tp_degree, text_encoder_tp_plan
from .checkpoint import (
    ModelFileError,
    TensorRef,
    WeightSource,
    build_empty,
    list_safetensors_shards,
    load_weights_into,
    resolve_model_location,
)
from .detect import describe_kind, detect_kind, infer_umt5_config
from .gguf_file import open_files
from .sharded import ShardedWeightSource

__all__ = ["SPIECE_KEY", "load_text_encoder", "load_text_encoder_shard", "load_text_encoder_tp", "open_text_encoder",
           "tokenizer_from_bytes"]

SPIECE_KEY = "spiece_model"
SPIECE_FILENAME = "spiece.model"
_SHARED = "shared.weight"
_EMBED_TOKENS = "encoder.embed_tokens.weight"


def tokenizer_from_bytes(model_proto: bytes, origin: str) -> sentencepiece.SentencePieceProcessor:
    try:
        tokenizer = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    except Exception as error:  # sentencepiece raises RuntimeError/OSError with terse text
        raise ModelFileError(f"{origin}: the SentencePiece tokenizer model is not valid ({error}).") from None
    if tokenizer.pad_id() != PAD_ID or tokenizer.eos_id() != EOS_ID:
        raise ModelFileError(
            f"{origin}: tokenizer ids pad={tokenizer.pad_id()}, eos={tokenizer.eos_id()}; umT5 needs pad=0, eos=1."
        )
    return tokenizer


def _find_spiece_file(folder: Path) -> Path:
    candidates = [folder / SPIECE_FILENAME, folder.parent / "tokenizer" / SPIECE_FILENAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        f"No SentencePiece tokenizer for {folder}: looked for {' and '.join(str(c) for c in candidates)}."
    )


def _embedding_source(source: WeightSource) -> tuple[WeightSource, dict[str, str]]:
    """Read the tied token embedding once and share it between `shared` and `encoder.embed_tokens`."""
    refs = dict(source.refs)
    if _SHARED not in refs and _EMBED_TOKENS in refs:
        refs[_SHARED] = refs[_EMBED_TOKENS]
    refs.pop(_EMBED_TOKENS, None)
    return WeightSource(refs, source.description), {_EMBED_TOKENS: _SHARED}


def _file_parts(path: Path, stack: contextlib.ExitStack):
    (checkpoint,) = open_files([path], stack)
    weight_keys = [key for key in checkpoint.weight_keys() if key != SPIECE_KEY]
    if detect_kind(weight_keys) != "umt5":
        raise ModelFileError(f"{path}: expected a umT5 text encoder (keys shared.weight, encoder.block.N.*), "
                             f"but this looks like {describe_kind(weight_keys)}.")
    if not checkpoint.has(SPIECE_KEY):
        raise ModelFileError(f"{path}: umT5 file without a '{SPIECE_KEY}' tensor (the SentencePiece model); "
                             f"use ComfyUI's umt5 file or a transformers folder with {SPIECE_FILENAME}.")
    tokenizer = tokenizer_from_bytes(checkpoint.raw(SPIECE_KEY).numpy().tobytes(), str(path))
    config = UMT5Config(**infer_umt5_config({key: checkpoint.shape(key) for key in weight_keys}))
    source = WeightSource({key: TensorRef(checkpoint, key) for key in weight_keys}, str(path))
    return config, source, tokenizer


def _folder_parts(folder: Path, stack: contextlib.ExitStack):
    config = UMT5Config.from_pretrained(folder)
    if config.model_type != "umt5":
        raise ModelFileError(f"{folder}/config.json describes model_type '{config.model_type}'; expected 'umt5'.")
    files = open_files(list_safetensors_shards(folder, "model"), stack)
    source = WeightSource({key: TensorRef(file, key) for file in files for key in file.weight_keys()}, str(folder))
    spiece_path = _find_spiece_file(folder)
    return config, source, tokenizer_from_bytes(spiece_path.read_bytes(), str(spiece_path))


def open_text_encoder(
    path: str | Path, stack: contextlib.ExitStack
) -> tuple[UMT5Config, WeightSource, dict[str, str], sentencepiece.SentencePieceProcessor]:
    """(config, weight source, tied-weight aliases, tokenizer) of a umT5 file or folder; reads no weights.

    The files stay open until ``stack`` closes. Shared by the single-device and the tensor-parallel loaders.
    """
    location = resolve_model_location(path, "text_encoder")
    parts = _folder_parts(location, stack) if location.is_dir() else _file_parts(location, stack)
    config, source, tokenizer = parts
    if tokenizer.get_piece_size() > config.vocab_size:
        raise ModelFileError(f"{location}: tokenizer has {tokenizer.get_piece_size()} tokens but the model "
                             f"embeds only {config.vocab_size}.")
    source, aliases = _embedding_source(source)
    return config, source, aliases, tokenizer


def load_text_encoder(path: str, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> TextEncoder:
    """umT5 from a ComfyUI single file (with `spiece_model`) or a transformers / diffusers pipeline folder."""
    with contextlib.ExitStack() as stack:
        config, source, aliases, tokenizer = open_text_encoder(path, stack)
        model = build_empty(lambda: UMT5EncoderModel(config))
        load_weights_into(model, source, dtype=dtype, device=device, aliases=aliases)
    return TextEncoder(model, tokenizer)



def load_text_encoder_shard(
    path: str | Path,
    *,
    tp_rank: int,
    tp_size: int,
    tp_group: dist.ProcessGroup | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TextEncoder:
    """Rank ``tp_rank`` of ``tp_size``'s shard of a umT5 encoder (every accepted format), reading only its slices.

    Loading needs no communication, so a shard can be loaded and inspected without a process group; encoding
    needs ``tp_group``. The degree is checked against the config before any weight is read.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size - 1}] for tp_size={tp_size}, got {tp_rank}")
    with contextlib.ExitStack() as stack:
        config, source, aliases, tokenizer = open_text_encoder(path, stack)
        check_text_encoder_tp_degree(config, tp_size)
        model = build_empty(lambda: UMT5EncoderModel(config))
        if tp_size > 1:
            plan = text_encoder_tp_plan(model)
            shard_planned_modules_(model, plan, tp_rank, tp_size, tp_group)
            source = ShardedWeightSource(source, plan.shard_dims(), tp_rank, tp_size)
        load_weights_into(model, source, dtype=dtype, device=device, aliases=aliases)
    return TextEncoder(model, tokenizer)


def load_text_encoder_tp(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_group: dist.ProcessGroup | None = None,
) -> TextEncoder:
    """This rank's tensor-parallel shard of a umT5 encoder over ``tp_group``; every rank of it must call this,
    and every rank must encode the same prompts together. With one rank this is the full encoder."""
    tp_size, tp_rank = tp_size_and_rank(tp_group)
    return load_text_encoder_shard(path, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                   dtype=dtype, device=device)

