"""Streaming on spawned gloo ranks equals one device: Ulysses 2 and 4, tp 2 and tp 2 x Ulysses 2.

One world of 4 ranks runs every layout (dp fills what a layout leaves). Each rank computes the single-device
result itself (the unsplit model, same seed) and checks, per layout: the cached stream with ONE fused all-to-all
per direction equals it; the unfused three-gather baseline equals it too; the uncached reference (masked, split
the same way) equals it; each rank's KV cache is 1/(tp x ulysses) of one device's; the collective calls per forward are what the design says (2 all-to-alls per block, no
gather in attention, when fused) and their bytes match ``exchange_bytes_per_chunk``; the model keeps its
ordinary context-parallel plan afterwards; a re-anchored rolling window (the sink turned later in time on every
rank's heads) equals one device's; streaming from a start image (its latent frame written to the cache
first) equals one device's too, and so does a stream whose prompt switches twice (the caches rebuilt under each
new prompt on every rank). Chunks of 2 over 5 frames of 3 x 3 tokens: 18 and 9 tokens, neither
divisible by 4 (padding), and a shorter last chunk.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from torch.distributed.device_mesh import init_device_mesh

from wanmesh.parallel.config import MESH_DIMS, ParallelConfig, rank_coordinates, stream_chunks
from wanmesh.parallel.distributed.causal_sp import exchange_bytes_per_chunk
from wanmesh.parallel.distributed.collectives import CollectiveCounter
from wanmesh.parallel.distributed.context_parallel import apply_context_parallel
from wanmesh.parallel.distributed.mesh import ParallelContext
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.distributed.tensor_parallel import apply_tensor_parallel
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, randomise_
from wanmesh.parallel.sampling.stream import sample_stream, stream_sigmas

TOLERANCE = 5e-5
SHAPE = (1, 16, 5, 6, 6)
CHUNK = 2
SIGMAS = stream_sigmas(3, 5.0)
LAYOUTS = (dict(ulysses=4), dict(ulysses=2), dict(tp=2), dict(tp=2, ulysses=2))
REANCHORED = dict(kv_window=3, sink=1, reanchor=True)  # the window rolls for the chunks ending at 4 and 5


def _model() -> WanTransformer3DModel:
    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(model, 11)
    return model.eval().requires_grad_(False)


def _context() -> torch.Tensor:
    return torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(5))


def _stream(model, plan=None, **options) -> torch.Tensor:
    return sample_stream(model, positive=_context(), negative=None, latent_shape=SHAPE, seed=3, sigmas=SIGMAS,
                         chunk=CHUNK, plan=plan, **options)


def _switches() -> dict[int, torch.Tensor]:
    """Two prompt switches: before chunk 1 and before the last chunk."""
    return {index: torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(seed))
            for index, seed in ((1, 9), (2, 13))}


def _start_latent() -> torch.Tensor:
    return torch.randn(1, 16, 1, *SHAPE[3:], generator=torch.Generator().manual_seed(7))


def _plan(rank: int, world: int, layout: dict) -> ParallelContext:
    config = ParallelConfig(world=world, **layout)
    mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=MESH_DIMS)
    return ParallelContext(config=config, rank=rank, device=torch.device("cpu"), mesh=mesh,
                           coords=rank_coordinates(config, rank))


def _check_close(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    error = (got - expected).abs().max().item()
    assert error < TOLERANCE, f"{name}: max difference {error} from one device"


def _forwards() -> int:
    chunks = len(stream_chunks(SHAPE[2], CHUNK))
    return chunks * (len(SIGMAS) - 1) + chunks - 1  # every step, plus the cache writes of all but the last chunk


def _expected_exchange(plan: ParallelContext, fused: bool) -> dict[str, int]:
    tokens_per_frame = (SHAPE[3] // 2) * (SHAPE[4] // 2)
    heads = TINY_TRANSFORMER["num_attention_heads"] // plan.size("tp")
    total = {"bytes": 0, "calls": 0}
    for _, count in stream_chunks(SHAPE[2], CHUNK):
        forwards = len(SIGMAS) - 1 + (1 if count == CHUNK else 0)  # the last (short) chunk is not written
        per = exchange_bytes_per_chunk(tokens=count * tokens_per_frame, heads=heads,
                                       head_dim=TINY_TRANSFORMER["attention_head_dim"],
                                       blocks=TINY_TRANSFORMER["num_layers"], degree=plan.size("ulysses"), fused=fused)
        total = {key: total[key] + forwards * per[key] for key in total}
    return total


def _output_gather_bytes(plan: ParallelContext) -> int:
    """Bytes one rank sends gathering the model output ([B, tokens/P, 16 x 2 x 2]) after every forward."""
    tokens_per_frame, degree = (SHAPE[3] // 2) * (SHAPE[4] // 2), plan.size("ulysses")
    total = 0
    for _, count in stream_chunks(SHAPE[2], CHUNK):
        forwards = len(SIGMAS) - 1 + (1 if count == CHUNK else 0)
        total += forwards * math.ceil(count * tokens_per_frame / degree) * 64 * 4 * (degree - 1)
    return total


def _check_layout(rank: int, world: int, layout: dict, reference: torch.Tensor, reference_cache: int,
                  reference_start: torch.Tensor, reference_switched: torch.Tensor,
                  reference_reanchored: torch.Tensor) -> None:
    plan = _plan(rank, world, layout)
    model = _model()
    apply_tensor_parallel(model, plan.tp_group)
    apply_context_parallel(model, ulysses_group=plan.ulysses_group)  # as the worker holds it
    name = f"layout {layout}"
    blocks, ulysses = TINY_TRANSFORMER["num_layers"], plan.size("ulysses")
    for fused in (True, False):
        stats = {}
        with CollectiveCounter() as counter:
            _check_close(f"{name} fused={fused}", _stream(model, plan, fused_all_to_all=fused, stats=stats), reference)
        shards = plan.size("tp") * ulysses  # the cache is split by heads over both
        assert stats["cache_bytes"] * shards == reference_cache, f"{name}: cache {stats['cache_bytes']} bytes"
        if ulysses > 1:
            a2a, gathers = counter.calls["all_to_all_single"], counter.calls["all_gather"]
            expected = (2 * blocks * _forwards(), _forwards()) if fused else (0, (4 * blocks + 1) * _forwards())
            assert (a2a, gathers) == expected, f"{name} fused={fused}: {a2a} all-to-alls, {gathers} gathers"
            exchange, output = _expected_exchange(plan, fused), _output_gather_bytes(plan)
            sent = (counter.sent["all_to_all_single"], counter.sent["all_gather"])
            expected_sent = (exchange["bytes"], output) if fused else (0, exchange["bytes"] + output)
            assert sent == expected_sent, f"{name} fused={fused}: sent {sent}, expected {expected_sent}"
    _check_close(f"{name} uncached", _stream(model, plan, use_cache=False), reference)
    _check_close(f"{name} from a start image", _stream(model, plan, start_latent=_start_latent()), reference_start)
    _check_close(f"{name} with prompt switches", _stream(model, plan, prompt_switches=_switches()), reference_switched)
    _check_close(f"{name} re-anchored", _stream(model, plan, **REANCHORED), reference_reanchored)
    # the ordinary sequence-parallel forward works again afterwards
    latents = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    own = model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=_context(),
                return_dict=False)[0]
    single = _model()(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=_context(),
                      return_dict=False)[0]
    _check_close(f"{name} ordinary forward after streaming", own, single)


def _rank_main(rank: int, world: int) -> None:
    with torch.no_grad():
        stats = {}
        reference = _stream(_model(), stats=stats)
        reference_start = _stream(_model(), start_latent=_start_latent())
        reference_switched = _stream(_model(), prompt_switches=_switches())
        assert (reference_switched - reference).abs().max() > 100 * TOLERANCE, "the switches change nothing"
        reference_reanchored = _stream(_model(), **REANCHORED)
        windowed = _stream(_model(), **{**REANCHORED, "reanchor": False})
        assert (reference_reanchored - windowed).abs().max() > 100 * TOLERANCE, "re-anchoring changes nothing"
        for layout in LAYOUTS:
            _check_layout(rank, world, layout, reference, stats["cache_bytes"], reference_start, reference_switched,
                          reference_reanchored)
            dist.barrier()


def test_stream_layouts_equal_one_device():
    spawn_ranks(_rank_main, 4, deadline_s=900.0, pg_timeout_s=300.0)


def test_exchange_bytes_formula_is_smaller_fused():
    fused = exchange_bytes_per_chunk(tokens=4680, heads=12, head_dim=128, blocks=30, degree=2)
    gathers = exchange_bytes_per_chunk(tokens=4680, heads=12, head_dim=128, blocks=30, degree=2, fused=False)
    assert fused["calls"] == 60 and gathers["calls"] == 120
    assert gathers["bytes"] == 2 * fused["bytes"] and math.isclose(fused["bytes"], 4 * 2340 * 12 * 128 * 4 * 30 / 2)
