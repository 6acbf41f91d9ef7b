"""`wanmesh bench i2v` on the tiny models: a row per model kind with a positive median inside its spread and the
ratio to T2V, written as JSON (no timed assertions)."""

from __future__ import annotations

import json

from wanmesh.parallel.bench.i2v import KINDS
from wanmesh.parallel.cli import main


def test_every_kind_is_timed_against_t2v(tiny_models_root, tmp_path):
    out = tmp_path / "i2v.json"
    flags = ["--width", "32", "--height", "32", "--frames", "5", "--repeats", "1", "--json", str(out)]
    assert main(["bench", "i2v", "--models", str(tiny_models_root), *flags]) == 0
    rows = json.loads(out.read_text())
    assert [row["kind"] for row in rows] == list(KINDS)
    for row in rows:
        low, high = row["spread_s"]
        assert 0 < low <= row["step_s"] <= high
    assert rows[0]["ratio_to_t2v"] == 1.0
