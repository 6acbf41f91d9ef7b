"""`wanmesh stream` never loses a chunk silently: a chunk folder deleted (or replaced by a file) during the stream
is a warning at the first chunk it cannot take; the chunks are kept and written into the folder when it is back;
when it never comes back the whole video is still written and the command fails (exit 1) naming the folder and the
chunk files it lacks. The folder events come from the test launcher (WANMESH_TEST_CHUNK_DIR_EVENTS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import LAUNCHER, RUN_TIMEOUT_S
from wanmesh.parallel.video_io import read_video

FRAMES, CHUNKS = 21, 6  # 6 latent frames in chunks of 1: 1 + 5 x 4 video frames
STREAM = ["--width", "32", "--height", "32", "--frames", str(FRAMES), "--chunk", "1", "--steps", "1", "--world", "2",
          "--device", "cpu"]


def _stream(models: Path, tmp_path: Path, events: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANMESH_WORKER_THREADS": "1", "WANMESH_TEST_CHUNK_DIR_EVENTS": events}
    args = ["stream", "--models", str(models), "--prompt", "a fox", *STREAM, "--out", str(tmp_path / "fox.mp4"),
            "--chunk-dir", str(tmp_path / "chunks")]
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S, cwd=tmp_path)


@pytest.fixture(scope="module")
def models(tiny_models) -> Path:
    return Path(tiny_models["t2v"]).parents[1]


def test_a_chunk_folder_that_disappears_for_good_fails_naming_the_lost_chunks(models, tmp_path):
    result = _stream(models, tmp_path, "2:remove")
    lines = result.stderr.strip().splitlines()
    chunks, out = tmp_path / "chunks", tmp_path / "fox.mp4"
    lost = ", ".join(f"chunk_{index:03d}.mp4" for index in range(CHUNKS))
    assert result.returncode == 1, result.stderr
    assert lines[-1] == (f"wanmesh: error: ChunksLost: {CHUNKS} chunk files are not in {chunks} (the chunk folder "
                         f"{chunks} disappeared): {lost}; the whole video is in {out}"), result.stderr
    assert f"wanmesh: warning: chunk_002.mp4 not written: the chunk folder {chunks} disappeared" in result.stderr
    assert not chunks.exists(), "the chunk folder was made again behind the user's back"
    assert read_video(out).shape[0] == FRAMES


def test_chunks_are_written_again_when_the_folder_is_back(models, tmp_path):
    result = _stream(models, tmp_path, "1:file,4:restore")
    chunks = tmp_path / "chunks"
    assert result.returncode == 0, result.stderr
    assert f"wanmesh: warning: chunk_001.mp4 not written: {chunks} is no longer a folder" in result.stderr
    assert f"wanmesh: warning: {chunks} is usable again: wrote chunk_000.mp4, chunk_001.mp4, chunk_002.mp4, " \
           "chunk_003.mp4, chunk_004.mp4" in result.stderr, result.stderr
    counts = [read_video(chunks / f"chunk_{index:03d}.mp4").shape[0] for index in range(CHUNKS)]
    assert counts == [1] + [4] * (CHUNKS - 1) and sum(counts) == read_video(tmp_path / "fox.mp4").shape[0]
