"""The context-parallel plan, sequence slicing, the attention processor and the head checks, without processes."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

from wanmesh.parallel.worker import residency as residency_module
from wanmesh.parallel.distributed.attention import attention
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.distributed.context_parallel import (
    ContextParallelAttnProcessor,
    SequenceShard,
    apply_context_parallel,
    check_ulysses_heads,
    context_parallel_plan,
)
from wanmesh.parallel.worker.executors import RankExecutor
from wanmesh.parallel.distributed.mesh import ParallelContext
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, TINY_VACE


@pytest.fixture(scope="module")
def t2v() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(**TINY_TRANSFORMER).eval().requires_grad_(False)


@pytest.mark.parametrize("valid_len,count", [(32, 2), (32, 3), (30, 4), (5, 4)])
def test_slices_cover_the_sequence_and_pad_its_end_with_zeros(valid_len, count):
    full = torch.arange(1, 2 * valid_len + 1, dtype=torch.float32).view(1, valid_len, 2)
    slices = [SequenceShard(valid_len, index, count).local_slice(full) for index in range(count)]
    shard = SequenceShard(valid_len, 0, count)
    assert all(piece.shape == (1, shard.local_len, 2) for piece in slices)
    joined = torch.cat(slices, dim=1)
    assert joined.shape[1] == shard.padded_len == -(-valid_len // count) * count
    assert torch.equal(joined[:, :valid_len], full)
    assert not joined[:, valid_len:].any()


def test_a_slice_of_something_else_than_the_whole_sequence_is_refused():
    with pytest.raises(ValueError, match="whole sequence of 32 tokens"):
        SequenceShard(32, 0, 2).local_slice(torch.zeros(1, 16, 4))


def test_t2v_plan_splits_block_0_and_replaces_every_self_attention(t2v):
    plan = context_parallel_plan(t2v)
    assert plan.rope == "rope" and plan.gather == "proj_out"
    assert plan.split_inputs == {"blocks.0": ("hidden_states",)}
    assert plan.attention_modules == tuple(f"blocks.{i}.attn1" for i in range(TINY_TRANSFORMER["num_layers"]))


def test_vace_plan_splits_the_context_tokens_where_they_enter():
    vace = WanVACETransformer3DModel(**TINY_VACE)
    plan = context_parallel_plan(vace)
    assert plan.split_inputs == {
        "vace_blocks.0": ("hidden_states", "control_hidden_states"),  # proj_in adds the video tokens here
        "vace_blocks.1": (),  # gets the previous VACE block's output, already split
        "blocks.0": ("hidden_states",),
    }
    assert {"vace_blocks.0.attn1", "vace_blocks.1.attn1", "blocks.3.attn1"} <= set(plan.attention_modules)
    assert not any(path.endswith("attn2") for path in plan.attention_modules)


class _LocalContext:
    """Stands in for the sequence-parallel context on one rank: plain local attention."""

    def attend(self, query, key, value):
        return attention(query, key, value)


def test_processor_with_local_attention_equals_diffusers_processor(t2v):
    latents = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(1))
    text = torch.randn(1, 7, TINY_TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(2))
    inputs = dict(hidden_states=latents, timestep=torch.tensor([500]), encoder_hidden_states=text, return_dict=False)
    with torch.no_grad():
        expected = t2v(**inputs)[0]
        originals = {path: t2v.get_submodule(path).processor for path in context_parallel_plan(t2v).attention_modules}
        try:
            for path in originals:
                t2v.get_submodule(path).set_processor(ContextParallelAttnProcessor(_LocalContext()))
            actual = t2v(**inputs)[0]
        finally:
            for path, processor in originals.items():
                t2v.get_submodule(path).set_processor(processor)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_groups_of_one_rank_leave_the_model_untouched(t2v):
    processor = t2v.blocks[0].attn1.processor
    assert apply_context_parallel(t2v, ring_group=None, ulysses_group=None) is t2v
    assert t2v.blocks[0].attn1.processor is processor
    assert getattr(t2v, "context_parallel", None) is None


def test_ulysses_that_does_not_divide_the_heads_is_refused():
    check_ulysses_heads(4, tp=2, ulysses=2)
    with pytest.raises(ValueError, match=r"tp x ulysses = 1 x 3 = 3 ranks; .*\(one of 1, 2, 4\)"):
        check_ulysses_heads(4, tp=1, ulysses=3)


def test_engine_checks_heads_before_reading_weights(tiny_models, monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were read before the head check")

    monkeypatch.setattr(residency_module.wan, "load_transformer", must_not_load)
    config = ParallelConfig(world=3, ulysses=3, devices="cpu")
    # A context that reports itself distributed; the check must fail before any process group is used.
    parallel = ParallelContext(config=config, rank=0, device=torch.device("cpu"), mesh=object(),
                               coords={"dp": 0, "cfg": 0, "ulysses": 0, "ring": 0, "tp": 0})
    with pytest.raises(ValueError, match="4 attention heads"):
        RankExecutor("cpu", parallel=parallel).load_model(str(tiny_models["t2v"]))


def test_causal_sequence_plan_names_modules_of_the_model(t2v):
    from wanmesh.parallel.distributed.causal_sp import causal_sequence_plan

    plan = causal_sequence_plan(t2v)
    assert plan.blocks == tuple(f"blocks.{i}" for i in range(len(t2v.blocks)))
    for path in (*plan.blocks, plan.gather_per_token, plan.gather):
        t2v.get_submodule(path)  # raises when the plan names a module the model does not have
    with pytest.raises(TypeError, match="not a Wan transformer"):
        causal_sequence_plan(torch.nn.Linear(2, 2))
