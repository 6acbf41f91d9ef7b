"""Tensor parallelism on spawned gloo ranks: sharded T2V / VACE sampling equals one device.

One world of 2 and one of 4 ranks. In each, every rank samples with the full model (the reference,
loaded by the ordinary single-device loader) and with its tensor-parallel shard (sharded loading), and
also checks: the output is identical on every rank, the all-reduce traffic of one forward matches the
plan's analytic count, the rank's parameter bytes are 1/tp of the sharded weights plus the replicated
ones, sharding a loaded model equals loading shards, and a VACE module merged onto T2V shards alike.
The world of 4 also runs tp=2 inside two sub-groups (group ranks, not global ranks, pick the shards).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from checks import assert_same_state
from wanmesh.parallel.auto_layout import Layout, block_calls
from wanmesh.parallel.distributed.collectives import CollectiveCounter
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample
from wanmesh.parallel.weights.sharded import load_transformer_tp, weight_bytes
from wanmesh.parallel.distributed.tensor_parallel import analytic_collectives, apply_tensor_parallel
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, make_tiny
from vace_inputs import two_vace_contexts

HARD_DEADLINE_S = 300.0
TOLERANCE = 1e-4
LATENT_SHAPE = (1, 16, 2, 8, 8)  # 2 x 4 x 4 = 32 video tokens after the 1x2x2 patch


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    return {name: str(path) for name, path in make_tiny(tmp_path_factory.mktemp("tp_tiny")).items()}


# ------------------------------------------------------------------ spawning


def _rank_entry(rank: int, world: int, check_name: str, paths: dict[str, str]) -> None:
    with torch.no_grad():
        globals()[check_name](rank, world, paths)


def _run_world(world: int, check_name: str, paths: dict[str, str]) -> None:
    spawn_ranks(_rank_entry, world, args=(check_name, paths), deadline_s=HARD_DEADLINE_S)


# ------------------------------------------------------------------ checks inside a rank


def _request(vace: bool) -> SampleRequest:
    generator = torch.Generator().manual_seed(7)
    text_dim = TINY_TRANSFORMER["text_dim"]
    return SampleRequest(
        handle="", latent=torch.zeros(LATENT_SHAPE), positive=[torch.randn(9, text_dim, generator=generator)],
        negative=[torch.randn(4, text_dim, generator=generator)], seed=3, steps=4, guidance_scale=5.0, shift=3.0,
        sampler="unipc",
        **(two_vace_contexts(LATENT_SHAPE, generator) if vace else {}),
    )


def _check_replicated(label: str, tensor: torch.Tensor, group) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    assert all(torch.equal(other, tensor) for other in gathered), f"{label}: ranks disagree"


def _check_sampling(label: str, reference: torch.nn.Module, sharded: torch.nn.Module, vace: bool, group) -> None:
    expected = sample(reference, _request(vace))
    got = sample(sharded, _request(vace))
    difference = (got - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{label}: max |tp - single device| = {difference:.3g} > {TOLERANCE}"
    _check_replicated(label, got, group)


def _forward_inputs(model: torch.nn.Module, vace: bool) -> dict:
    generator = torch.Generator().manual_seed(11)
    inputs = {"hidden_states": torch.randn(LATENT_SHAPE, generator=generator), "timestep": torch.tensor([500]),
              "encoder_hidden_states": torch.randn(1, 512, model.config.text_dim, generator=generator),
              "return_dict": False}
    if vace:
        inputs["control_hidden_states"] = torch.randn(1, 96, *LATENT_SHAPE[2:], generator=generator)
    return inputs


def _check_traffic(label: str, sharded: torch.nn.Module, vace: bool, tp: int) -> None:
    with CollectiveCounter() as counter:
        sharded(**_forward_inputs(sharded, vace))
    config = sharded.config
    blocks = config.num_layers + len(getattr(config, "vace_layers", None) or ())
    expected = analytic_collectives(
        num_blocks=blocks, batch=1,
        video_tokens=LATENT_SHAPE[2] * LATENT_SHAPE[3] * LATENT_SHAPE[4] // 4, text_tokens=512,
        dim=config.num_attention_heads * config.attention_head_dim, tp=tp, activation_bytes=4,
    )
    assert set(counter.calls) == {"all_reduce"}, f"{label}: unexpected collectives {counter.as_dict()}"
    assert counter.calls["all_reduce"] == expected["calls"], f"{label}: {counter.as_dict()} vs {expected}"
    assert counter.calls["all_reduce"] == blocks * block_calls(Layout(tp=tp))["all_reduce"]  # the auto layout's price
    assert counter.sent["all_reduce"] == expected["sent_bytes"], f"{label}: {counter.as_dict()} vs {expected}"


def _check_weight_bytes(label: str, full: torch.nn.Module, sharded: torch.nn.Module, tp: int) -> None:
    full_bytes, local_bytes = weight_bytes(full), weight_bytes(sharded)
    assert full_bytes["sharded"] > 2 * full_bytes["replicated"], f"{label}: the plan shards too little"
    assert local_bytes["sharded"] * tp == full_bytes["sharded"], f"{label}: {local_bytes} vs full {full_bytes}"
    assert local_bytes["replicated"] == full_bytes["replicated"], f"{label}: {local_bytes} vs full {full_bytes}"


def _check_model(kind: str, paths: dict[str, str], group, tp: int) -> None:
    vace = kind == "vace"
    full = load_transformer(paths[kind])
    sharded = load_transformer_tp(paths[kind], tp_group=group)
    label = f"{kind} tp={tp}"
    _check_sampling(label, full, sharded, vace, group)
    _check_traffic(label, sharded, vace, tp)
    _check_weight_bytes(label, full, sharded, tp)
    assert_same_state(f"{label}: apply_tensor_parallel vs sharded loading",
                apply_tensor_parallel(copy.deepcopy(full), group), sharded)
    if vace:
        merged = load_transformer_tp(paths["t2v"], vace_module=paths["vace_module"], tp_group=group)
        assert_same_state(f"{label}: VACE module merged onto T2V", merged, sharded)


def _check_image_cross_attention(group, tp: int) -> None:
    """Wan I2V's extra image key/value projections shard like the text ones (one forward, built in memory)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(5)
    config = dict(TINY_TRANSFORMER, num_layers=2, image_dim=48, added_kv_proj_dim=128)
    full = WanTransformer3DModel(**config).eval()
    sharded = apply_tensor_parallel(copy.deepcopy(full), group)
    inputs = _forward_inputs(full, vace=False)
    inputs["encoder_hidden_states_image"] = torch.randn(1, 6, 48, generator=torch.Generator().manual_seed(2))
    difference = (sharded(**inputs)[0] - full(**inputs)[0]).abs().max().item()
    assert difference <= TOLERANCE, f"I2V tp={tp}: max |tp - single device| = {difference:.3g}"


def check_whole_world(rank: int, world: int, paths: dict[str, str]) -> None:
    for kind in ("t2v", "vace"):
        _check_model(kind, paths, None, world)
    _check_image_cross_attention(None, world)


def check_whole_world_and_subgroups(rank: int, world: int, paths: dict[str, str]) -> None:
    check_whole_world(rank, world, paths)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    full = load_transformer(paths["t2v"])
    _check_sampling("t2v tp=2 sub-group", full, load_transformer_tp(paths["t2v"], tp_group=group), False, group)


# ------------------------------------------------------------------ tests


def test_tp2_matches_single_device(tiny_paths):
    _run_world(2, "check_whole_world", tiny_paths)


def test_tp4_and_tp2_subgroups_match_single_device(tiny_paths):
    _run_world(4, "check_whole_world_and_subgroups", tiny_paths)
