"""`wanmesh bench vae` through the command line: the Wan 2.2 VAE's tiled decode and encode at vae_patch 1 and 2 give
the same output (max_diff), every tile runs on exactly one rank, the medians sit inside their spreads, and bad
options are one-line errors before any rank starts (no timed assertions)."""

from __future__ import annotations

import json

import pytest

from wanmesh.parallel.cli import main

SMALL = ["--base-dim", "8", "--frames", "5", "--height", "64", "--width", "64", "--tile-px", "32",
         "--overlap-px", "16"]


def test_wan22_vae_patch_parallel_rows(tmp_path):
    out = tmp_path / "vae.json"
    assert main(["bench", "vae", "--vae", "2.2", *SMALL, "--stages", "decode,encode", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["latent_shape"] == [1, 48, 2, 4, 4]  # 16x spatial, 48 channels
    rows = report["rows"]
    for stage in ("decode", "encode"):
        base = [r for r in rows if r["stage"] == stage and r["vae_patch"] == 1]
        split = [r for r in rows if r["stage"] == stage and r["vae_patch"] == 2]
        assert len(base) == 1 and len(split) == 2
        assert sum(r["tiles"] for r in split) == base[0]["tiles"] > 1
        assert all(r["tiles"] > 0 for r in split)
        for row in base + split:
            low, high = row["spread_s"]
            assert 0 < low <= row["median_s"] <= high
            assert row["max_diff"] <= 1e-5
    assert [(s["stage"], s["vae_patch"]) for s in report["speedups"]] == [("decode", 2), ("encode", 2)]
    assert all(s["speedup"] > 0 for s in report["speedups"])


@pytest.mark.parametrize("flags, message", [
    (["--vae", "2.2", "--height", "72"], "multiples of 16"),
    (["--height", "68"], "multiples of 8"),
    (["--stages", "decode,render"], "--stages takes decode and/or encode"),
    (["--frames", "6"], "4n + 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_options_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "vae", *flags]) != 0
    *phase, error = capsys.readouterr().err.strip().splitlines()  # the benchmark's phase line, then the error
    assert message in error and error.startswith("wanmesh: error: ") and len(phase) <= 1
