"""`wanmesh bench families` through the command line on the tiny preset (world 1, one step, one run; the families'
files written on the fly): every family timed and counted, the added modules' FLOPs above T2V's, the table printed,
JSON and plot written (no timed assertions); a bad family name fails in one line before anything runs."""

from __future__ import annotations

import json

from wanmesh.parallel.cli import main
from wanmesh.parallel.tiny.families import FAMILIES, FAMILY_NAMES


def test_bench_families_reports_every_family(tmp_path, capsys):
    out, plot, models = tmp_path / "families.json", tmp_path / "families.png", tmp_path / "models"
    assert main(["bench", "families", "--preset", "tiny", "--models", str(models), "--steps", "1", "--repeats", "1",
                 "--width", "32", "--height", "32", "--frames", "1", "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert [row["family"] for row in rows] == list(FAMILIES)
    for row in rows:
        assert row["step_s"] > 0 and len(row["runs_s"]) == 1 and row["flops_per_step"] > 0
        assert row["flops_first_call"] >= row["flops_later_call"] > 0
        assert sum(row["flops_by_module"].values()) == row["flops_first_call"]
    t2v, *variants = rows
    assert t2v["ratio_to_t2v"] == 1.0 and t2v["flop_ratio"] == 1.0 and t2v["within_flop_ratio"] is None
    for row in variants:
        assert row["flop_ratio"] > 1 and row["added_flop_share"] > 0
        assert isinstance(row["within_flop_ratio"], bool) and row["ratio_to_t2v"] > 0
    animate = rows[FAMILIES.index("animate")]
    assert animate["flops_first_call"] > animate["flops_later_call"]  # the face encoders run once per face video
    assert {"motion_encoder", "face_encoder", "face_adapter"} <= set(animate["flops_by_module"])
    assert "ref_conv" in rows[FAMILIES.index("fun22_control")]["flops_by_module"]
    header = next(line for line in printed.splitlines() if line.startswith("layout"))
    assert "x T2V" in header and "FLOP x" in header and "within" in header
    for family in FAMILIES:
        assert any(line.startswith("world1") and FAMILY_NAMES[family] in line for line in printed.splitlines())
    assert plot.stat().st_size > 0


def test_bench_families_refuses_an_unknown_family_first(tmp_path, capsys):
    assert main(["bench", "families", "--families", "t2v,phantom", "--models", str(tmp_path / "models"),
                 "--json", str(tmp_path / "x.json")]) != 0
    error = capsys.readouterr().err
    assert "--families: phantom" in error and "animate" in error and len(error.strip().splitlines()[-1]) <= 300
    assert not (tmp_path / "models").exists() and not (tmp_path / "x.json").exists()
