"""Shared unit-test fixtures: the tiny model tree (written once per session), its in-memory models, and the seeded
tiny T2V transformer and text contexts the causal streaming tests run."""

from __future__ import annotations


import pytest


@pytest.fixture(scope="session")
def tiny_reference():
    """The in-memory tiny models the files were written from."""
    from wanmesh.parallel.tiny.models import build_tiny_models

    return build_tiny_models()


@pytest.fixture(scope="module")
def causal_model():
    """The tiny T2V transformer with seeded random weights (what streaming runs causally)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, randomise_

    torch.manual_seed(0)
    t2v = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(t2v, 11)
    return t2v.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def text_contexts():
    """A positive and a negative text context [1, 512, text_dim] (seeded)."""
    import torch

    from wanmesh.parallel.tiny.models import TINY_TRANSFORMER

    generator = torch.Generator().manual_seed(5)
    dim = TINY_TRANSFORMER["text_dim"]
    return torch.randn(1, 512, dim, generator=generator), torch.randn(1, 512, dim, generator=generator)
