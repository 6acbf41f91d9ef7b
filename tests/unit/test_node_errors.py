"""How worker failures reach the ComfyUI UI: a short exception name, one line with the rank and what to do,
the worker traceback in the log; a failed decode keeps the latents; VAE Encode refuses bad sizes before any
worker work. The nodes run here with a stand-in runner (no ComfyUI, no pool)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from wanmesh.nodes import NODE_CLASS_MAPPINGS
from wanmesh.nodes.bridge.errors import WanMeshWorkerError
from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.parallel import WorkerError

TRACEBACK = 'Traceback (most recent call last):\n  File "executors.py", line 1\nRuntimeError: boom'


class FailingRunner:
    def __init__(self, error: WorkerError):
        self.error, self.calls = error, []

    def decode(self, *args, **kwargs):
        self.calls.append("decode")
        raise self.error

    def encode(self, *args, **kwargs):
        self.calls.append("encode")
        raise self.error

    def load_vae(self, *args, **kwargs):
        self.calls.append("load_vae")
        raise self.error


@pytest.fixture()
def output_folder(tmp_path, monkeypatch):
    module = types.ModuleType("folder_paths")
    module.get_output_directory = lambda: str(tmp_path)
    monkeypatch.setitem(sys.modules, "folder_paths", module)
    return tmp_path


def test_a_worker_error_is_one_short_line_and_the_traceback_goes_to_the_log(caplog):
    runner = FailingRunner(WorkerError(1, "RuntimeError", "CUDA error: device-side assert\nmore detail", TRACEBACK))
    node = NODE_CLASS_MAPPINGS["WanMeshVAEEncode"]()
    with caplog.at_level(logging.ERROR, logger="wanmesh"), pytest.raises(WanMeshWorkerError) as raised:
        node.encode(ResidentModel(runner, "vae|x"), torch.zeros(5, 32, 32, 3))
    message = str(raised.value)
    assert message == ("rank 1: RuntimeError: CUDA error: device-side assert — rank 1's traceback is in the "
                       "ComfyUI log")
    assert "\n" not in message and "Traceback" not in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    # ComfyUI shows module + qualname unless the module is 'builtins'
    assert type(raised.value).__module__ == "builtins" and type(raised.value).__qualname__ == "WanMeshWorkerError"
    assert TRACEBACK in caplog.text


def test_a_stopped_pool_says_to_queue_again():
    runner = FailingRunner(WorkerError(0, "WorkerDied", "the worker process was killed by SIGKILL during encode"))
    with pytest.raises(WanMeshWorkerError, match=r"^rank 0: WorkerDied: .* queue the prompt again"):
        NODE_CLASS_MAPPINGS["WanMeshVAEEncode"]().encode(ResidentModel(runner, "vae|x"), torch.zeros(5, 32, 32, 3))


def test_a_cause_that_says_the_pool_stopped_is_not_said_twice():
    cause = "host 10.0.0.2 was lost with ranks 2, 3 during sample; the pool was stopped and the next request starts a fresh one"
    runner = FailingRunner(WorkerError(2, "WorkerDied", cause))
    with pytest.raises(WanMeshWorkerError) as raised:
        NODE_CLASS_MAPPINGS["WanMeshVAEEncode"]().encode(ResidentModel(runner, "vae|x"), torch.zeros(5, 32, 32, 3))
    assert str(raised.value) == f"rank 2: WorkerDied: {cause} — queue the prompt again (details in the ComfyUI log)"
    assert str(raised.value).count("pool was stopped") == 1


def test_a_failed_decode_saves_the_latents_and_says_where(output_folder):
    runner = FailingRunner(WorkerError(0, "RuntimeError", "decode failed", TRACEBACK))
    latents = torch.randn(1, 16, 2, 4, 4)
    with pytest.raises(WanMeshWorkerError, match="the latents were saved to ") as raised:
        NODE_CLASS_MAPPINGS["WanMeshVAEDecode"]().decode(ResidentModel(runner, "vae|x"), {"samples": latents})
    saved = str(raised.value).rsplit("the latents were saved to ", 1)[1]
    assert saved.startswith(str(output_folder / "wanmesh_latents"))
    assert torch.equal(load_file(saved)["latents"], latents)


def test_vae_encode_refuses_frames_smaller_than_the_vae_before_the_worker():
    runner = FailingRunner(WorkerError(0, "RuntimeError", "must not be reached"))
    with pytest.raises(ValueError, match=r"width 4 is smaller than the VAE's 8 pixels \(valid: 8 or more\)"):
        NODE_CLASS_MAPPINGS["WanMeshVAEEncode"]().encode(ResidentModel(runner, "vae|x"), torch.zeros(5, 32, 4, 3))
    assert runner.calls == []
