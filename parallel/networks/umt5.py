"""umT5 text encoding for Wan: the model, its SentencePiece tokenizer, and prompt -> embeddings; runs in the workers.

Encoding follows diffusers' `WanPipeline._get_t5_prompt_embeds`: clean the prompt (ftfy, HTML unescape,
whitespace collapse), tokenize with EOS appended, pad to 512 with an attention mask, run the encoder,
and trim each result to its real tokens. umT5 ids: pad 0, eos 1, unk 2, no BOS.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import sentencepiece
import torch
from transformers import UMT5Config, UMT5EncoderModel

from .checkpoint import (
    ModelFileError,
    TensorRef,
    WeightSource,
    build_empty,
    list_safetensors_shards,
    load_weights_into,
    resolve_model_location,
)
from .gguf_file import open_files
from .detect import describe_kind, detect_kind, infer_umt5_config
from ..config import TEXT_TOKENS

SPIECE_KEY = "spiece_model"
SPIECE_FILENAME = "spiece.model"
PAD_ID = 0
EOS_ID = 1
MAX_LENGTH = TEXT_TOKENS
_SHARED = "shared.weight"
_EMBED_TOKENS = "encoder.embed_tokens.weight"


def clean_prompt(text: str) -> str:
    """The prompt cleaning of diffusers' Wan pipelines (ftfy fix, HTML unescape, whitespace collapse)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


class TextEncoder:
    """A umT5 encoder and its tokenizer; `encode` turns prompts into per-prompt embeddings."""

    def __init__(self, model: UMT5EncoderModel, tokenizer: sentencepiece.SentencePieceProcessor,
                 max_length: int = MAX_LENGTH):
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def hidden_size(self) -> int:
        return self.model.config.d_model

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, both [B, max_length]: EOS appended, truncated, padded with 0."""
        _check_prompts(prompts)
        ids = torch.full((len(prompts), self.max_length), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), self.max_length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens = self.tokenizer.encode(clean_prompt(prompt))[: self.max_length - 1] + [EOS_ID]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        return ids, mask

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One float32 CPU tensor [L_i, hidden] per prompt, L_i = its real token count including EOS."""
        ids, mask = self.tokenize(prompts)
        device = next(self.model.parameters()).device
        hidden = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        hidden = hidden.to(device="cpu", dtype=torch.float32)
        return [states[:length] for states, length in zip(hidden, mask.sum(dim=1).tolist())]


def _check_prompts(prompts: list[str]) -> None:
    if isinstance(prompts, str) or not all(isinstance(prompt, str) for prompt in prompts):
        raise TypeError(f"prompts must be a list of strings, got {type(prompts).__name__}"
                        f"{'' if isinstance(prompts, str) else ' containing non-strings'}.")


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


__all__ = ["TextEncoder", "clean_prompt", "load_text_encoder", "open_text_encoder", "tokenizer_from_bytes"]
