"""`wanmesh bench plan` on the tiny model and two CPU ranks: every layout measured, the JSON and plot written."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from wanmesh.parallel.cli import main


@pytest.fixture(scope="module")
def calibration_cache(tmp_path_factory):
    """One calibration for the module's runs (the same machine and world)."""
    return str(tmp_path_factory.mktemp("cache"))


def test_bench_plan_measures_every_layout_and_names_the_choice(tiny_models, tmp_path, monkeypatch, capsys,
                                                               calibration_cache):
    monkeypatch.setenv("WANMESH_CACHE", calibration_cache)
    models = tiny_models["t2v"].parent.parent
    assert main(["bench", "plan", "--models", str(models), "--world", "2", "--devices", "cpu", "--width", "64",
                 "--height", "48", "--frames", "5", "--steps", "1", "--repeats", "1", "--pools", "together",
                 "--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]) == 0
    result = json.loads((tmp_path / "plan.json").read_text())
    names = [row["layout"] for row in result["layouts"]]
    assert sorted(names) == sorted(["one rank per job (data parallel)", "tp 2", "ulysses 2", "ring 2",
                                    "cfg_parallel"])
    assert result["chosen"] in names and result["best_measured"] in names and -1 <= result["spearman"] <= 1
    assert all(row["predicted_s"] > 0 and row["min_s"] <= row["measured_s"] <= row["max_s"]
               for row in result["layouts"])
    assert result["chosen_over_best"] >= 1 and (tmp_path / "plan.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "auto chose:" in out and "measuring 5 layouts, every pool up at once" in out


def test_bench_plan_measures_one_pool_at_a_time_when_the_pools_do_not_fit_together(tiny_models, tmp_path,
                                                                                    monkeypatch, capsys,
                                                                                    calibration_cache):
    """With the pools predicted not to fit beside each other (here: each worker's own memory set beyond what is
    free), ``--pools auto`` measures them in turn; the rows are the predicted best layouts, each timed."""
    import wanmesh.parallel.bench.plan as plan

    monkeypatch.setenv("WANMESH_CACHE", calibration_cache)
    monkeypatch.setattr(plan, "WORKER_PROCESS_BYTES", 2**50)
    models = tiny_models["t2v"].parent.parent
    assert main(["bench", "plan", "--models", str(models), "--world", "2", "--devices", "cpu", "--width", "64",
                 "--height", "48", "--frames", "5", "--steps", "1", "--repeats", "1", "--max-layouts", "2",
                 "--json", str(tmp_path / "plan.json")]) == 0
    assert "measuring 2 layouts, one pool at a time" in capsys.readouterr().out
    result = json.loads((tmp_path / "plan.json").read_text())
    assert len(result["layouts"]) == 2 and result["chosen"] == result["layouts"][0]["layout"]
    assert all(0 < row["min_s"] <= row["measured_s"] <= row["max_s"] for row in result["layouts"])


def test_pools_stay_up_together_only_while_each_rank_has_cores_of_its_own():
    """``--pools auto``: four one-thread CPU ranks on two cores are measured one pool at a time (idle pools slowed
    the measured one there); two ranks, or ranks on GPUs (no cores recorded), stay together; pools that do not fit
    in memory never do."""
    from wanmesh.parallel.auto_layout import Layout, Link, Machine, Prediction
    from wanmesh.parallel.bench.plan import together_by_default
    from wanmesh.parallel.config import ParallelConfig

    link = Link(1e-4, 1e9)
    machine = Machine(matmul_flops=1e11, attention_flops=1e11, all_reduce=link, all_to_all=link, send_recv=link,
                      free_bytes=2**34, cpu_cores=2, rank_threads=1)
    subset = [Prediction(Layout(ulysses=2), 1.0, 1.0, 0.0, memory_bytes=2**20, fits=True)] * 4
    assert together_by_default(subset, machine, ParallelConfig(world=2, devices="cpu"))
    assert not together_by_default(subset, machine, ParallelConfig(world=4, devices="cpu"))
    gpus = replace(machine, cpu_cores=0)
    assert together_by_default(subset, gpus, ParallelConfig(world=4, devices="cpu"))
    assert not together_by_default(subset, replace(gpus, free_bytes=2**20), ParallelConfig(world=4, devices="cpu"))
