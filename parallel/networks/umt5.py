"""umT5 text encoding for Wan: the model with its SentencePiece tokenizer, and prompt -> embeddings; runs in the
workers. Reading the model and the tokenizer from files is ``weights/umt5_files.py``.

Encoding follows diffusers' `WanPipeline._get_t5_prompt_embeds`: clean the prompt (ftfy, HTML unescape,
whitespace collapse), tokenize with EOS appended, pad to 512 with an attention mask, run the encoder,
and trim each result to its real tokens. umT5 ids: pad 0, eos 1, unk 2, no BOS.
"""

from __future__ import annotations

import sentencepiece
import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import UMT5EncoderModel

from ..config import TEXT_TOKENS

__all__ = ["EOS_ID", "PAD_ID", "TextEncoder", "clean_prompt"]

PAD_ID = 0
EOS_ID = 1
MAX_LENGTH = TEXT_TOKENS


def clean_prompt(text: str) -> str:
    """The prompt cleaning of diffusers' Wan pipelines (ftfy fix, HTML unescape, whitespace collapse)."""
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

