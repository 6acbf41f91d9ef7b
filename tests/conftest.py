"""Test-wide settings (never reach a model hub, keep CPU threads modest on small CI machines) and the one tiny model
tree the unit, distributed and fault tests share (written once per session)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Shared test helpers (tests/vace_inputs.py, ...) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Paths of the tiny models `make_tiny` writes (keys: t2v, vace, vae, text_encoder, vace_module, diffusers_*)."""
    from wanmesh.parallel.tiny.models import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_models_root(tiny_models) -> Path:
    """The tree's root (what `--models` takes)."""
    return tiny_models["t2v"].parents[1]
