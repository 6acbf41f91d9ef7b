"""Tensor-parallel umT5 on two spawned gloo ranks: the embeddings equal one device's on every rank.

Each rank encodes a few prompts with the full encoder (the single-device loader, the reference) and with
its shard (sharded loading, from the ComfyUI file and from the transformers folder), checks the results
agree within 1e-5 and are identical on both ranks, that its sharded matrices take half the bytes, and that
sharding a loaded encoder equals loading the shard.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from checks import assert_same_state
from wanmesh.parallel.weights.sharded import weight_bytes
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.weights.umt5_files import load_text_encoder
from wanmesh.parallel.networks.umt5_tp import apply_text_encoder_tp, text_encoder_tp_plan
from wanmesh.parallel.weights.umt5_files import load_text_encoder_tp
from wanmesh.parallel.tiny.models import make_tiny

HARD_DEADLINE_S = 120.0
TOLERANCE = 1e-5
PROMPTS = ["A red fox jumps over a snowy log in a pine forest.", "", "a lighthouse at night, waves, storm " * 20]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    return {name: str(path) for name, path in make_tiny(tmp_path_factory.mktemp("te_tp_tiny")).items()}


def _check_replicated(label: str, tensor: torch.Tensor) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    assert all(torch.equal(other, tensor) for other in gathered), f"{label}: ranks disagree"


def _check_encoding(label: str, expected: list[torch.Tensor], sharded) -> None:
    got = sharded.encode(PROMPTS)
    for row, (ours, reference) in enumerate(zip(got, expected)):
        assert ours.shape == reference.shape, f"{label} prompt {row}: {ours.shape} vs {reference.shape}"
        difference = (ours - reference).abs().max().item()
        assert difference <= TOLERANCE, f"{label} prompt {row}: max |tp - single device| = {difference:.3g}"
        _check_replicated(f"{label} prompt {row}", ours.contiguous())


def _check_weight_bytes(label: str, full: torch.nn.Module, sharded: torch.nn.Module) -> None:
    plan = text_encoder_tp_plan(full)
    full_bytes, local_bytes = weight_bytes(full, plan), weight_bytes(sharded, plan)
    assert full_bytes["sharded"] > full_bytes["replicated"], f"{label}: the plan shards too little"
    assert local_bytes["sharded"] * 2 == full_bytes["sharded"], f"{label}: {local_bytes} vs full {full_bytes}"
    assert local_bytes["replicated"] == full_bytes["replicated"], f"{label}: {local_bytes} vs full {full_bytes}"


def check_text_encoder_tp2(rank: int, world: int, paths: dict[str, str]) -> None:
    full = load_text_encoder(paths["text_encoder"])
    expected = full.encode(PROMPTS)
    for label, path in (("ComfyUI file", paths["text_encoder"]), ("transformers folder", paths["diffusers_t2v"])):
        sharded = load_text_encoder_tp(path, tp_group=None)
        _check_encoding(label, expected, sharded)
        _check_weight_bytes(label, full.model, sharded.model)
    assert_same_state("apply_text_encoder_tp vs sharded loading",
                apply_text_encoder_tp(copy.deepcopy(full.model), None), sharded.model)


def _rank_entry(rank: int, world: int, paths: dict[str, str]) -> None:
    with torch.no_grad():
        check_text_encoder_tp2(rank, world, paths)


def test_tp2_text_encoder_matches_single_device(tiny_paths):
    spawn_ranks(_rank_entry, 2, args=(tiny_paths,), deadline_s=HARD_DEADLINE_S)
