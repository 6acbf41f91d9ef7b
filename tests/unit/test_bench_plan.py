"""`wanmesh bench plan` on the tiny model and two CPU ranks: every layout measured, the JSON and plot written."""

from __future__ import annotations

import json

from wanmesh.parallel.cli import main


def test_bench_plan_measures_every_layout_and_names_the_choice(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path / "cache"))
    models = tiny_models["t2v"].parent.parent
    assert main(["bench", "plan", "--models", str(models), "--world", "2", "--devices", "cpu", "--width", "64",
                 "--height", "48", "--frames", "5", "--steps", "1", "--repeats", "1", "--json",
                 str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]) == 0
    result = json.loads((tmp_path / "plan.json").read_text())
    names = [row["layout"] for row in result["layouts"]]
    assert sorted(names) == sorted(["one rank per job (data parallel)", "tp 2", "ulysses 2", "ring 2",
                                    "cfg_parallel"])
    assert result["chosen"] in names and result["best_measured"] in names and -1 <= result["spearman"] <= 1
    assert all(row["predicted_s"] > 0 and row["min_s"] <= row["measured_s"] <= row["max_s"]
               for row in result["layouts"])
    assert result["chosen_over_best"] >= 1 and (tmp_path / "plan.png").stat().st_size > 0
    assert "auto chose:" in capsys.readouterr().out
