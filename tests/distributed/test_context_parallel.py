"""Context parallelism through the worker pool equals one device, for the T2V and the VACE model.

Each configuration starts one pool and samples both models (4 unipc steps with CFG); the final latents
must equal those of a single-device Engine in this process within 1e-4. Configurations: ring 2; ring 3
over a sequence that does not divide by 3 (padded and masked); Ulysses 2; Ulysses 2 x ring 2 (USP, also
over a sequence that does not divide by 4); TP 2 x ring 2; CFG parallel x ring 2. Then `wanmesh generate`
with Ulysses 2 x ring 2 equals `--world 1`.
"""

from __future__ import annotations

from dataclasses import replace

import math

import pytest
import torch
from safetensors.torch import load_file

from pool_helpers import (cpu_pool, one_thread_per_worker, random_prompt_request,  # noqa: F401
                          tiny_model_paths, traceback_deadline)
from wanmesh.parallel.cli import main
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.worker.executors import RankExecutor
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER
from vace_inputs import two_vace_contexts

DEADLINE_S = 900  # the whole file; a hung rank dumps every thread's stack and ends the run
TOLERANCE = 1e-4
PATCH = TINY_TRANSFORMER["patch_size"]
EVEN = (1, 16, 2, 8, 8)  # 2 x 4 x 4 = 32 tokens: even over 2 and 4 ranks, not over 3
UNEVEN_FOR_4 = (1, 16, 2, 6, 10)  # 2 x 3 x 5 = 30 tokens

CONFIGS = {
    "ring2": (dict(world=2, ring=2), [EVEN]),
    "ring3_uneven": (dict(world=3, ring=3), [EVEN]),
    "ulysses2": (dict(world=2, ulysses=2), [EVEN]),
    "ulysses2_ring2": (dict(world=4, ulysses=2, ring=2), [EVEN, UNEVEN_FOR_4]),
    "tp2_ring2": (dict(world=4, tp=2, ring=2), [EVEN]),
    "tp2_ulysses2": (dict(world=4, tp=2, ulysses=2), [EVEN]),
    "cfg_parallel_ring2": (dict(world=4, cfg_parallel=True, ring=2), [EVEN]),
}


def _tokens(shape: tuple[int, ...]) -> int:
    return math.prod(size // patch for size, patch in zip(shape[2:], PATCH))


def _request(shape: tuple[int, ...], vace: bool) -> SampleRequest:
    generator = torch.Generator().manual_seed(7)
    request = random_prompt_request(torch.zeros(shape), generator, seed=3, steps=4, guidance_scale=5.0, shift=3.0,
                                    sampler="unipc")
    return replace(request, **two_vace_contexts(shape, generator)) if vace else request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with traceback_deadline(DEADLINE_S):
        root = tmp_path_factory.mktemp("cp_tiny")
        yield {**tiny_model_paths(root), "root": str(root)}


@pytest.fixture(scope="module")
def reference(tiny):
    """Single-device latents, computed on demand and kept, keyed by (model, latent shape)."""
    engine = RankExecutor("cpu")
    handles = {kind: engine.load_model(tiny[kind]) for kind in ("t2v", "vace")}
    cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def latents(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        if (kind, shape) not in cache:
            cache[kind, shape] = engine.sample(replace(_request(shape, vace=kind == "vace"), handle=handles[kind]))
        return cache[kind, shape]

    return latents


def test_the_uneven_cases_really_pad():
    assert _tokens(EVEN) % 3 and _tokens(UNEVEN_FOR_4) % 4
    assert _tokens(EVEN) % 4 == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_context_parallel_equals_one_device(name, tiny, reference):
    degrees, shapes = CONFIGS[name]
    with cpu_pool(**degrees) as pool:
        runner = PoolRunner(pool)
        for kind in ("t2v", "vace"):
            handle = runner.load_model(tiny[kind])
            for shape in shapes:
                expected = reference(kind, shape)
                actual = runner.sample(replace(_request(shape, vace=kind == "vace"), handle=handle))
                assert actual.shape == expected.shape
                error = (actual - expected).abs().max().item()
                assert error <= TOLERANCE, f"{name} {kind} {shape}: max difference {error}"
            runner.unload(handle)
    assert expected.std() > 0.1


def _generate(models: str, out_dir, name: str, *flags: str) -> torch.Tensor:
    main([
        "generate", "--models", models, "--prompt", "a lighthouse at night", "--negative", "blurry",
        "--width", "64", "--height", "48", "--frames", "5", "--steps", "4", "--sampler", "unipc", "--seed", "3",
        "--device", "cpu", "--out", str(out_dir / f"{name}.mp4"), "--save-latents", str(out_dir / f"{name}.safetensors"),
        *flags,
    ])
    return load_file(out_dir / f"{name}.safetensors")["latents"]


def test_generate_with_ulysses_and_ring_equals_one_rank(tiny, tmp_path):
    single = _generate(tiny["root"], tmp_path, "single", "--world", "1")
    usp = _generate(tiny["root"], tmp_path, "usp", "--world", "4", "--ulysses", "2", "--ring", "2")
    assert single.std() > 0.1
    assert (usp - single).abs().max() <= TOLERANCE
