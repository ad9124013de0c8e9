"""GPUDirect Storage readiness from recorded node trees (driver, nvidia-fs, cufile.json), judged with
the paths' filesystems; one line and no error on this machine, which has no NVIDIA driver."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tierio.cli.main import main
from tierio.diag.doctor import PathFacts, Recorded, diagnose
from tierio.diag.gdscheck import GdsFacts, cufile_settings, record_gds, rule_gds
from tierio.diag.rules import OK, SKIPPED, WARN
from tierio.errors import FormatError

CUFILE = Path(__file__).parent / "data" / "doctor" / "gds" / "cufile.json"


def gpu_node(root: Path, nvidia_fs: str | None) -> Path:
    (root / "proc/driver/nvidia/gpus/0000:03:00.0").mkdir(parents=True)
    (root / "proc/driver/nvidia/gpus/0000:83:00.0").mkdir(parents=True)
    (root / "etc").mkdir()
    shutil.copy(CUFILE, root / "etc/cufile.json")
    if nvidia_fs is not None:
        (root / "sys/module/nvidia_fs").mkdir(parents=True)
        (root / "sys/module/nvidia_fs/version").write_text(nvidia_fs + "\n")
    return root


def test_cufile_settings_read_through_comments():
    s = cufile_settings(CUFILE.read_text(), str(CUFILE))
    assert s == {"allow_compat_mode": True, "max_direct_io_size_kb": 16384, "max_device_cache_size_kb": 131072,
                 "use_poll_mode": False, "rdma_dev_addr_list": ["172.16.8.88", "172.16.8.89"],
                 "fs.lustre.rdma_dev_addr_list": ["172.16.8.88"]}
    with pytest.raises(FormatError, match="not JSON"):
        cufile_settings("{ properties: }", "bad.json")


def test_driver_without_nvidia_fs_falls_back(tmp_path):
    facts = record_gds(str(gpu_node(tmp_path, None)))
    assert facts.driver and facts.gpus == 2 and facts.nvidia_fs is None and facts.cufile["allow_compat_mode"]
    f = rule_gds(facts, [("/mnt/nvme", "xfs", "rw,noatime"), ("/shared", "nfs4", "rw,proto=tcp")])
    assert f.verdict == WARN and "nvidia-fs not loaded" in f.detail and "modprobe nvidia-fs" in f.fix
    assert "POSIX fallback for /shared (nfs4)" in f.detail and f.data["gds_paths"] == ["/mnt/nvme"]


def test_nvidia_fs_loaded_and_kvikio_modes(tmp_path):
    facts = record_gds(str(gpu_node(tmp_path, "2.17.5")))
    assert facts.nvidia_fs == "2.17.5" and facts.kvikio is None          # kvikio is asked on a live node only
    ok = rule_gds(facts, [("/lustre/ckpt", "lustre", "rw,flock"), ("/shared", "nfs4", "rw,proto=rdma")])
    assert ok.verdict == OK and "nvidia-fs 2.17.5" in ok.detail and "max_direct_io_size_kb=16384" in ok.detail
    facts.kvikio = "compat"
    compat = rule_gds(facts)
    assert compat.verdict == WARN and "compatibility mode" in compat.detail and "allow_compat_mode" in compat.fix


def test_replayed_and_one_line_without_a_driver(tmp_path, capsys):
    rec = Recorded(paths=[PathFacts("/mnt/nvme", fs_type="xfs")], gds=record_gds(str(gpu_node(tmp_path, None))).to_dict())
    again = Recorded.from_dict(json.loads(json.dumps(rec.to_dict())))
    (g,) = [x for x in diagnose(again) if x.check == "GPUDirect Storage"]
    assert g.verdict == WARN
    here = record_gds()
    if not here.driver:                                                   # this machine
        assert rule_gds(here).verdict == SKIPPED
        assert main(["probe", "--gds", str(tmp_path)]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out == ["GPUDirect Storage: skipped: no NVIDIA driver on this node: GDS not applicable, reads use "
                       "the host path"]
    assert GdsFacts(**here.to_dict()) == here
