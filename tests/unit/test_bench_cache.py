"""`wanmesh bench cache` on the tiny model (world 1, a few steps): rows for no cache and each setting, the skip
counts and calls agree, JSON and plot written; a bad setting fails before any pool starts."""

from __future__ import annotations

import json

from wanmesh.parallel.cli import main


def test_bench_cache_writes_table_json_and_plot(tmp_path, tiny_models):
    out, plot = tmp_path / "cache.json", tmp_path / "cache.png"
    assert main(["bench", "cache", "--models", str(tiny_models["t2v"].parent.parent), "--layouts", "world1",
          "--steps", "5", "--width", "32", "--height", "32", "--frames", "1", "--cache", "teacache:0.5:start=0.1",
          "--repeats", "2", "--json", str(out), "--plot", str(plot)]) == 0
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert len(written["load_average"]["before"]) == 3 and written["repeats"] == 2
    assert all(len(row["runs_s"]) == 2 and row["spread_s"] >= 0 for row in rows)  # every setting ran each repeat
    assert all(len(row["runs_cpu_s"]) == 2 and row["cpu_s"] > 0 for row in rows)  # the ranks' CPU time
    assert [row["cache"] for row in rows] == ["none", "teacache:0.5:start=0.1"]
    plain, cached = rows
    assert plain["calls"] == 10 and plain["rel_l2"] == 0.0
    assert cached["calls"] == 2 * (5 - cached["skipped"]) and cached["vs_world1_max_abs"] == 0.0
    assert (cached["skipped"] > 0) == (cached["rel_l2"] > 0)
    assert plot.stat().st_size > 0


def test_bench_cache_refuses_a_bad_setting_first(tmp_path, capsys):
    assert main(["bench", "cache", "--cache", "nocache:0.1", "--json", str(tmp_path / "x.json")]) != 0
    assert "method 'nocache' is unknown" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
