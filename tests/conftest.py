"""Test-wide settings (never reach a model hub, keep CPU threads modest on small CI machines, Ctrl-C reaches the
processes the tests start) and the one tiny model tree the unit, distributed and fault tests share (written once per
session)."""

import os
import signal
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A run started in the background of a non-interactive shell has SIGINT ignored, and every process it starts (ComfyUI,
# the CLI, the workers) would inherit that, so the tests that send SIGINT would see nothing happen. Handling it here
# hands the processes started from now on the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The 25 test files that took longest (setup, call and teardown summed): where the run's time goes, which the
    per-step list (``--durations``) spreads over hundreds of lines."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration, nodeid = getattr(report, "duration", None), getattr(report, "nodeid", "")
            if duration is not None and nodeid:
                path = nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + duration
    if per_file:
        terminalreporter.write_sep("=", "slowest 25 test files")
        for path, seconds in sorted(per_file.items(), key=lambda item: -item[1])[:25]:
            terminalreporter.write_line(f"{seconds:8.1f}s {path}")
