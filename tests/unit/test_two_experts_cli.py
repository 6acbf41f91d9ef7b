"""`wanmesh generate` with two experts: bad boundaries and step ranges exit with code 2 and a one-line message
before any worker starts, and a run with --model-low reports which steps each expert ran."""

from __future__ import annotations

import pytest

from wanmesh.parallel.cli import main


def _generate(tiny_models, tmp_path, *flags: str) -> int:
    return main(["generate", "--models", str(tiny_models["t2v"].parent.parent), "--prompt", "a fox", "--device", "cpu",
          "--width", "64", "--height", "48", "--frames", "5", "--steps", "4", "--sampler", "euler",
          "--out", str(tmp_path / "x.mp4"), *flags])


@pytest.mark.parametrize("flags, message", [
    (["--boundary", "1.5"], "boundary must be a number in [0, 1]"),
    (["--start-step", "3", "--end-step", "2"], "start_step=3, end_step=2 is not valid for 4 steps"),
    (["--cfg-low", "-2"], "low-noise expert's guidance scale (cfg_low) must be a finite number >= 0"),
])
def test_bad_two_expert_flags_exit_2_before_the_pool_starts(tiny_models, tmp_path, capsys, flags, message):
    code = _generate(tiny_models, tmp_path, "--model-low", str(tiny_models["t2v_low"]), *flags)
    error = capsys.readouterr().err
    assert code == 2 and message in error and error.count("\n") == 1
    assert not (tmp_path / "x.mp4").exists()


def test_generate_with_a_low_noise_expert_reports_the_split(tiny_models, tmp_path, capsys):
    _generate(tiny_models, tmp_path, "--model-low", str(tiny_models["t2v_low"]), "--boundary", "0.875")
    # euler / simple, shift 3 (the tiny default), 4 steps: timesteps 1000, 900, 750, 500 -> two at or above 875
    assert "high-noise expert: steps 0-1, low-noise expert: steps 2-3" in capsys.readouterr().err
    assert (tmp_path / "x.mp4").stat().st_size > 0
