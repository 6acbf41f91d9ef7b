"""The validation pass's own checks, in process (no workers): ranks against cores and devices, output paths,
the per-rank memory budget."""

from __future__ import annotations

import torch
import pytest

from wanmesh.parallel.config import ParallelConfig, ranks_over_cores_warning
from wanmesh.parallel.validation import check_output_path, check_ranks
from wanmesh.parallel.worker.memory import machine_ram_bytes, memory_budget_bytes, resident_bytes


def test_more_cpu_ranks_than_cores_warns_with_the_numbers():
    warning = ranks_over_cores_warning(ParallelConfig(world=8, devices="cpu"), cpu_cores=2)
    assert warning == ("world=8 puts 8 ranks on the CPU but this machine has 2 cores; ranks will share cores "
                       "(use world <= 2 on CPU)")
    assert ranks_over_cores_warning(ParallelConfig(world=2, devices="cpu"), cpu_cores=2) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_a_device_list_naming_missing_gpus_is_refused_before_any_pool():
    with pytest.raises(ValueError, match=r"devices cuda:0, cuda:1 do not exist: no GPU is visible; use devices='cpu'"):
        check_ranks(ParallelConfig(world=2, devices="cuda:0,cuda:1"))


def test_output_folders_are_created_and_unwritable_paths_refused(tmp_path):
    target = tmp_path / "a" / "b" / "clip.mp4"
    assert check_output_path(target, "--out", (".mp4",)) == target and target.parent.is_dir()
    assert list(target.parent.iterdir()) == []  # the probe file is gone
    with pytest.raises(ValueError, match=r"^--out .* is a folder; give a file name$"):
        check_output_path(tmp_path, "--out")


def test_memory_budget_is_the_setting_or_a_share_of_the_ram():
    assert memory_budget_bytes(1.5, torch.device("cpu")) == 1_500_000_000
    assert memory_budget_bytes(0.0, torch.device("cpu"), ranks_on_machine=4) == int(machine_ram_bytes() * 0.5 / 4)
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, shared, torch.nn.BatchNorm1d(4))  # shared weights count once
    expected = (16 + 4 + 4 + 4 + 4 + 4) * 4 + 8  # linear, norm weight/bias, running mean/var (fp32), count (int64)
    assert resident_bytes(model) == expected
