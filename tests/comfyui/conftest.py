"""Fixtures for the tests against a real ComfyUI server with this pack in its ``custom_nodes``.

The servers run on the ComfyUI copies that ``tests/tools/prepare_comfyui.py``
makes (``comfyui_server``: the 2024 copy; ``recent_comfyui_server``: ComfyUI
0.33), with tiny models written by ``wanmesh make-tiny``. Each is started once
per test process and shared by its modules, as a user's server serves one
workflow after another (a start and stop costs about 16 s of the 2 cores, paid
once instead of per module); a module that counts the server's pools or memory
from a known start takes ``own_comfyui_server`` / ``own_recent_comfyui_server``,
started for that module alone. Outside CI a ComfyUI copy that cannot be prepared (no
access to the package registry) skips these tests; with ``CI=true`` it fails
them, so CI never passes without having run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO_ROOT / "tests" / "tools"
sys.path.insert(0, str(TOOLS_DIR))

from comfyui_server import (ComfyUIServer, RecentComfyUIServer, copy_workflow_inputs,  # noqa: E402
                            write_model_paths_config)
from workflow_graph import load_workflow, with_fresh_seed  # noqa: E402

TINY_MODEL_FILES = ("diffusion_models/wan_tiny_t2v.safetensors", "diffusion_models/wan_tiny_t2v_Q8_0.gguf",
                    "diffusion_models/wan_tiny_vace.safetensors",
                    "vae/wan_tiny_vae.safetensors", "text_encoders/umt5_tiny.safetensors",
                    "loras/wan_tiny_lora_comfy.safetensors", "loras/wan_tiny_lora_kohya.safetensors")
SERVER_START_TIMEOUT_S = 180.0


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _run_quietly(command: list[str], what: str, timeout_s: float) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def _prepared_comfyui(which: str) -> Path:
    """Run ``prepare_comfyui.py --which <which>`` and return the folder it prints (fail in CI, else skip)."""
    try:
        result = _run_quietly([sys.executable, str(TOOLS_DIR / "prepare_comfyui.py"), "--which", which],
                              f"preparing the {which} ComfyUI copy", timeout_s=600)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        if running_in_ci():
            pytest.fail(f"CI=true and no {which} ComfyUI copy: {error}")
        pytest.skip(f"no {which} ComfyUI copy (run tests/tools/prepare_comfyui.py --which {which}): {error}")
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def comfyui_dir() -> Path:
    """The prepared 2024 ComfyUI copy (``build/comfyui``) with this pack in ``custom_nodes``."""
    return _prepared_comfyui("2024")


@pytest.fixture(scope="session")
def recent_comfyui_dir() -> Path:
    """The prepared ComfyUI 0.33 copy (``build/comfyui-recent``) with this pack in ``custom_nodes``.

    Preparing it also installs what that ComfyUI needs (frontend, templates, av, ...) into this Python.
    """
    return _prepared_comfyui("recent")


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models tree written by ``wanmesh make-tiny``."""
    models = tmp_path_factory.mktemp("models")
    # The console script may not be on PATH (pack used from a checkout): call its entry point.
    _run_quietly([sys.executable, "-c", "import sys; from wanmesh.parallel.cli import main; "
                  "sys.exit(main(sys.argv[1:]))", "make-tiny", str(models)], "wanmesh make-tiny", timeout_s=300)
    missing = [name for name in TINY_MODEL_FILES if not (models / name).is_file()]
    assert not missing, f"wanmesh make-tiny did not write {missing} under {models}"
    return models


def _serve(server_class: type[ComfyUIServer], comfy_dir: Path, tiny_models_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """Start a server with the tiny models and the workflows' input media, hand it over, then stop it and check
    that it left no processes."""
    work_dir = tmp_path_factory.mktemp("comfyui")
    config = write_model_paths_config(tiny_models_dir, work_dir / "extra_model_paths.yaml")
    server = server_class(comfy_dir, work_dir, config, extra_env={"OMP_NUM_THREADS": "1"})
    copy_workflow_inputs(server.input_dir)
    try:
        server.start(SERVER_START_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    yield server
    left_behind = server.stop()
    assert not left_behind, f"processes outlived the ComfyUI server (killed now): {left_behind}"


@pytest.fixture(scope="session")
def comfyui_server(comfyui_dir: Path, tiny_models_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """The shared running 2024 ComfyUI server; at the end of the session it is stopped and must leave no
    processes behind."""
    yield from _serve(ComfyUIServer, comfyui_dir, tiny_models_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def recent_comfyui_server(recent_comfyui_dir: Path, tiny_models_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """The shared running ComfyUI 0.33 server; at the end of the session it is stopped and must leave no processes
    behind."""
    yield from _serve(RecentComfyUIServer, recent_comfyui_dir, tiny_models_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def own_comfyui_server(comfyui_dir: Path, tiny_models_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """A 2024 ComfyUI server of this module alone (no pool or cache of other modules in it)."""
    yield from _serve(ComfyUIServer, comfyui_dir, tiny_models_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def own_recent_comfyui_server(recent_comfyui_dir: Path, tiny_models_dir: Path,
                              tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """A ComfyUI 0.33 server of this module alone (no pool or cache of other modules in it)."""
    yield from _serve(RecentComfyUIServer, recent_comfyui_dir, tiny_models_dir, tmp_path_factory)


class LruCacheComfyUIServer(RecentComfyUIServer):
    """ComfyUI 0.33 with ``--cache-lru``: outputs of earlier prompts stay cached (as with the LRU and RAM caches
    users turn on), so a cached node output can outlive the pool it holds."""

    def command(self) -> list[str]:
        return super().command() + ["--cache-lru", "64"]


@pytest.fixture(scope="module")
def lru_comfyui_server(recent_comfyui_dir: Path, tiny_models_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """A running ComfyUI 0.33 server with the LRU node cache; it must leave no processes behind."""
    yield from _serve(LruCacheComfyUIServer, recent_comfyui_dir, tiny_models_dir, tmp_path_factory)


@pytest.fixture()
def t2v_prompt() -> dict[str, Any]:
    """``workflows/api/t2v.json`` with a fresh seed."""
    return with_fresh_seed(load_workflow("api/t2v.json"))
