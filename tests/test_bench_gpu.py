"""The GPU tooling where there is no GPU: the benchmark's arguments, its "nothing to measure" exit,
the PCIe arithmetic, the table it prints from a result file, and the GDS mode read from each kvikio
generation (the measurements themselves run in scripts/gpu-check.sh)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tierio.bench import gpu


def test_arguments_are_checked_and_sizes_parsed():
    args = gpu.parse(["--size", "64MiB", "--parts", "d2h,kv", "--rounds", "2"])
    assert args.size == 64 << 20 and args.parts == ["d2h", "kv"] and args.rounds == 2
    assert gpu.parse([]).parts == list(gpu.PARTS)
    for bad in (["--parts", "d2h,gds"], ["--parts", ""], ["--rounds", "0"], ["--size", "lots"]):
        with pytest.raises(SystemExit) as exc:
            gpu.parse(bad)
        assert exc.value.code == 2, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_exits_77_saying_why(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == gpu.SKIP
    assert "CUDA is not available" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_pcie_figures_per_generation(monkeypatch):
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "1, 16, 5, 16, NVIDIA H200\n", ""))
    link = gpu.pcie_link()
    assert (link["gen"], link["gen_max"], link["width_max"], link["gpu"]) == (1, 5, 16, "NVIDIA H200")
    assert link["bytes_per_s"] == pytest.approx(63.0e9, rel=0.01)  # gen 5 x16, 128b/130b
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "[N/A]\n", ""))
    assert "skipped" in gpu.pcie_link()
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    assert gpu.pcie_link() == {"skipped": "nvidia-smi is not installed"}


def test_the_table_names_every_part_and_its_targets(tmp_path, capsys):
    res = {"d2h": {"snapshot_bytes_per_s": 40e9, "ratios": {"d2h_snapshot_vs_memcpy": 0.9},
                   "pcie": {"skipped": "nvidia-smi is not installed"}},
           "save": {"error": "OSError: no space"}, "weights": {"gds_compat_mode": True, "ratios": {}}, "nccl": {"skipped": "NCCL needs 2 GPUs, this machine has 1"},
           "targets_met": {"d2h_snapshot_vs_memcpy": True}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert gpu.main(["--table", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "d2h_snapshot_vs_memcpy" in out and ">=0.8 met" in out and "d2h.snapshot_GB/s" in out and "40.00" in out
    assert "FAILED" in out and "no space" in out and "NCCL needs 2 GPUs" in out
    assert "d2h.pcie" in out and "nvidia-smi is not installed" in out and "compat" in out


@pytest.mark.parametrize("defaults, expected", [
    ({"is_compat_mode_preferred": lambda: False, "compat_mode": None}, False),  # newer kvikio (26.10 has no compat_mode)
    ({"compat_mode": lambda: True}, True),  # older kvikio: a function
    ({"compat_mode": False}, False),  # the oldest: a value
], ids=["preferred", "function", "value"])
def test_gds_mode_is_read_from_every_kvikio_generation(monkeypatch, defaults, expected):
    import sys
    import types

    from tierio.io import gds

    kvikio = types.ModuleType("kvikio")
    kvikio.defaults = types.SimpleNamespace(**defaults)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kvikio.defaults)
    monkeypatch.setattr(gds, "available", lambda: True)
    assert gds.compat_mode() is expected
