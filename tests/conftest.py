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


# The files that take longest on a 2-core machine (the "slowest test files" summary of a whole run), longest first.
# They are queued before the others, so that the two pytest processes of a run (pytest-xdist, one file at a time
# each) do not end with one of them still working through a long file while the other idles. tests/run.sh passes
# --no-loadscope-reorder: by default pytest-xdist queues the files by their number of tests instead.
LONGEST_FILES = (
    "comfyui/test_browser_workflows.py", "comfyui/test_model_kinds.py", "unit/test_bench_real_size.py",
    "distributed/test_two_hosts.py", "comfyui/test_native_sampling.py", "distributed/test_dtype_matrix.py",
    "distributed/test_context_parallel.py", "faults/test_validation_cli.py", "comfyui/test_native_model_patches.py",
    "comfyui/test_image_to_video.py", "faults/test_shutdown_driver.py", "unit/test_cli.py",
    "distributed/test_block_streaming.py", "distributed/test_pool.py", "unit/test_bench_plan.py",
    "faults/test_shutdown_comfyui.py", "comfyui/test_fun22_control.py", "unit/test_cli_vace.py",
    "distributed/test_pool_ray.py", "distributed/test_tensor_parallel.py", "comfyui/test_load_two_clients.py",
    "comfyui/test_phantom_and_tracks.py", "distributed/test_image_to_video_pool.py", "unit/test_cli_progress.py",
    "unit/test_bench_vae.py", "distributed/test_ti2v_pool.py", "comfyui/test_animate.py",
    "unit/test_gpu_check_dry_run.py", "distributed/test_stream_sp.py", "comfyui/test_comfyui_server.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Queue the LONGEST_FILES first, in that order; the other files keep their order after them."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}

    def file_rank(item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=file_rank)  # stable: the tests of a file keep their order


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The 25 test files that took longest (setup, call and teardown summed): where the run's time goes, which the
    per-step list (``--durations``) spreads over hundreds of lines; every file's in build/test-output/file-seconds.txt."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller reports the whole run
        return
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration, nodeid = getattr(report, "duration", None), getattr(report, "nodeid", "")
            if duration is not None and nodeid:
                path = nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + duration
    if per_file:
        ranked = sorted(per_file.items(), key=lambda item: -item[1])
        terminalreporter.write_sep("=", "slowest 25 test files")
        for path, seconds in ranked[:25]:
            terminalreporter.write_line(f"{seconds:8.1f}s {path}")
        # Every file, for refreshing LONGEST_FILES from a whole run.
        listing = Path(__file__).resolve().parents[1] / "build" / "test-output" / "file-seconds.txt"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text("".join(f"{seconds:8.1f} {path}\n" for path, seconds in ranked))
