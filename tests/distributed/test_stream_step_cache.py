"""Step caching in causal streaming: within each chunk (its steps counted from 0, no state carried over from the
previous chunk), the KV cache writes never skipped, and Ulysses 2 takes one device's decisions and gives its
latents with one all-reduce per step. Two spawned gloo ranks each compute the one-device stream themselves (the unsplit model, same cache
settings). 5 frames in chunks of 3: 27 and 18 tokens, the first not divisible by 2 (a padded slice)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from torch.distributed.device_mesh import init_device_mesh

from wanmesh.parallel.cache_settings import CacheSettings
from wanmesh.parallel.config import MESH_DIMS, ParallelConfig, rank_coordinates, stream_chunks
from wanmesh.parallel.distributed.collectives import CollectiveCounter
from wanmesh.parallel.distributed.mesh import ParallelContext
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.sampling.stream import sample_stream, stream_sigmas
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, randomise_

SHAPE = (1, 16, 5, 6, 6)
CHUNK = 3
STEPS = 4
# thresholds that skip steps on the tiny random model (how many is measured, not assumed: at least one)
RUNS = {"teacache": (CacheSettings("teacache", 2.0, start_percent=0.1), 1.0),
        "magcache": (CacheSettings("magcache", 0.2, start_percent=0.1), 3.0)}


def _model() -> WanTransformer3DModel:
    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(model, 11)
    return model.eval().requires_grad_(False)


def _context(seed: int) -> torch.Tensor:
    return torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(seed))


def _stream(model, method: str | None, plan=None) -> tuple[torch.Tensor, dict]:
    settings, guidance = RUNS[method] if method else (None, 1.0)
    stats: dict = {}
    latents = sample_stream(model, positive=_context(5), negative=_context(6), latent_shape=SHAPE, seed=3,
                            sigmas=stream_sigmas(STEPS, 5.0), chunk=CHUNK, guidance_scale=guidance, plan=plan,
                            stats=stats, step_cache=settings)
    return latents, stats


def _plan(rank: int, world: int) -> ParallelContext:
    config = ParallelConfig(world=world, ulysses=2)
    mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=MESH_DIMS)
    return ParallelContext(config=config, rank=rank, device=torch.device("cpu"), mesh=mesh,
                           coords=rank_coordinates(config, rank))


def _check_one_device(method: str, latents: torch.Tensor, report: dict, uncached: torch.Tensor) -> None:
    chunks = len(stream_chunks(SHAPE[2], CHUNK))
    branches = 2 if RUNS[method][1] != 1.0 else 1
    assert report["skipped"] >= 1 and report["computed"] + report["skipped"] == chunks * STEPS, (method, report)
    # every chunk computes its first step (no history carried over from the chunk before)
    assert all(chunk * STEPS not in report["skipped_steps"] for chunk in range(chunks)), (method, report)
    # the branches skip together, and every KV cache write (all chunks but the last) runs the blocks
    assert report["calls"] == branches * (report["computed"] + chunks - 1), (method, report)
    if branches == 1:
        assert not torch.equal(latents, uncached)


def _rank_main(rank: int, world: int) -> None:
    with torch.no_grad():
        uncached, _ = _stream(_model(), None)
        expected = {method: _stream(_model(), method) for method in RUNS}
        for method, (latents, stats) in expected.items():
            _check_one_device(method, latents, stats["cache_report"], uncached)
        plan, model = _plan(rank, world), _model()
        for method, (latents, stats) in expected.items():
            with CollectiveCounter() as counter:
                got, got_stats = _stream(model, method, plan)
            # one all-reduce of the whole-tensor sums per step (the deciding pass's; the other branch follows)
            assert counter.calls["all_reduce"] == len(stream_chunks(SHAPE[2], CHUNK)) * STEPS, dict(counter.calls)
            assert got_stats["cache_decisions"] == stats["cache_decisions"], (method, got_stats["cache_report"])
            error = (got - latents).abs().max().item()
            assert error <= 1e-4, f"{method}: max difference {error} from one device"
            dist.barrier()


def test_ulysses_stream_takes_one_device_decisions():
    spawn_ranks(_rank_main, 2, deadline_s=600.0, pg_timeout_s=300.0)
