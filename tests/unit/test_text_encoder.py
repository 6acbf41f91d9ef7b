"""umT5 prompt encoding equals diffusers' Wan pipeline (transformers tokenizer + UMT5EncoderModel)."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanPipeline
from transformers import T5Tokenizer

from wanmesh.parallel.weights.umt5_files import load_text_encoder

PROMPTS = [
    "A cat sits on a red sofa in the warm afternoon light.",
    "  Two   astronauts\n walk on the moon &amp;amp; wave  ",
    "Zebra quokka xylophone: unseen words, ÜNÏCÖDÉ and emoji 🚀!",
    "",
]
LONG_PROMPT = " ".join(["a dog runs along the beach"] * 120)  # far beyond 512 tokens


@pytest.fixture(scope="module")
def file_encoder(tiny_models):
    return load_text_encoder(str(tiny_models["text_encoder"]))


@pytest.fixture(scope="module")
def reference_pipeline(tiny_models):
    return WanPipeline.from_pretrained(tiny_models["diffusers_t2v"])


def test_tokenizer_matches_transformers(file_encoder, tiny_models):
    reference = T5Tokenizer.from_pretrained(tiny_models["diffusers_t2v"] / "tokenizer")
    from wanmesh.parallel.networks.umt5 import clean_prompt

    prompts = PROMPTS + [LONG_PROMPT]
    ids, mask = file_encoder.tokenize(prompts)
    expected = reference([clean_prompt(p) for p in prompts], padding="max_length", max_length=512,
                         truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    assert ids.shape == mask.shape == (len(prompts), 512)
    assert torch.equal(ids, expected.input_ids) and torch.equal(mask, expected.attention_mask)
    assert ids[0, mask[0].sum() - 1] == 1 and mask[-1].sum() == 512 and ids[-1, -1] == 1  # EOS kept
    assert ids[3, 0] == 1 and mask[3].sum() == 1  # empty prompt is just EOS


def test_encode_matches_wan_pipeline(file_encoder, reference_pipeline):
    prompts = PROMPTS + [LONG_PROMPT]
    ours = file_encoder.encode(prompts)
    expected = reference_pipeline._get_t5_prompt_embeds(
        prompts, max_sequence_length=512, device=torch.device("cpu"), dtype=torch.float32)
    _, mask = file_encoder.tokenize(prompts)
    for row, embedding in enumerate(ours):
        length = int(mask[row].sum())
        assert embedding.shape == (length, 64) and embedding.dtype == torch.float32
        torch.testing.assert_close(embedding, expected[row, :length], rtol=1e-5, atol=1e-5)
        assert embedding.std() > 0.1


def test_file_and_folder_encoders_agree(file_encoder, tiny_models):
    folder_encoder = load_text_encoder(str(tiny_models["diffusers_t2v"]))
    for ours, theirs in zip(file_encoder.encode(PROMPTS), folder_encoder.encode(PROMPTS)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert file_encoder.hidden_size == folder_encoder.hidden_size == 64
    assert file_encoder.max_length == 512


def test_encoding_is_per_prompt(file_encoder):
    alone = file_encoder.encode([PROMPTS[0]])[0]
    batched = file_encoder.encode([PROMPTS[1], PROMPTS[0]])[1]
    torch.testing.assert_close(alone, batched, rtol=1e-5, atol=1e-5)


def test_bad_prompts_are_rejected(file_encoder):
    with pytest.raises(TypeError, match="list of strings"):
        file_encoder.encode("a single string")
    with pytest.raises(TypeError, match="non-strings"):
        file_encoder.encode(["ok", 3])
