"""Fault-suite fixtures: the tiny model tree written once per session, and helpers to run the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Paths of the tiny models `make_tiny` writes (keys: t2v, vace, vae, text_encoder, vace_module, diffusers_*)."""
    from wanmesh.parallel.tiny.models import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_models"))
