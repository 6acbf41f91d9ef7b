"""Shared unit-test fixtures: the tiny model tree (written once per session) and its in-memory models."""

from __future__ import annotations


import pytest


@pytest.fixture(scope="session")
def tiny_reference():
    """The in-memory tiny models the files were written from."""
    from wanmesh.parallel.tiny.models import build_tiny_models

    return build_tiny_models()
