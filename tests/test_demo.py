"""`tierio demo --quick` end to end, and proof that its bit-exact check can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierio.cli.main import main
from tierio.demo import DemoConfig, run_demo
from tierio.errors import ConfigError


def test_demo_quick_json(tmp_path, capsys):
    rc = main(["demo", "--quick", "--json", "--dir", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out)
    assert d["bit_exact"] is True and d["mismatches"] == []
    assert d["saves"] >= 2 and 0 < d["resumed_from"] < d["steps"]
    # The local tier was deleted, so the restore must have come from the shared-FS tier.
    assert d["restored_from"].endswith("/shared-fs")
    assert [t["role"] for t in d["tiers"]] == ["local-nvme", "shared-fs", "archive"]
    assert all(t["checkpoints"] >= 1 and t["bytes_written"] > 0 for t in d["tiers"])
    assert d["blocking_s_mean"] > 0 and d["sync_save_s"] > 0
    # The replacement node starts with an empty local disk.
    assert not list((tmp_path / "demo" / "local-nvme").glob("step_*"))
    # What the demo leaves behind is a set of real checkpoints the ckpt command can read.
    assert main(["ckpt", "verify", str(tmp_path / "demo" / "shared-fs"), "--all", "--json"]) == 0


def test_demo_cli_not_a_tty_prints_plain_lines(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "tierio", "demo", "--quick", "--dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "bit for bit" in r.stdout and "Traceback" not in r.stderr
    # No live-display control sequences when stderr is a pipe.
    assert "\x1b[" not in r.stderr and "\r" not in r.stderr
    assert "simulated failure" in r.stderr and "checkpoint 5" in r.stderr


@pytest.mark.parametrize("fault", ["skip-rng", "skip-data", "perturb"])
def test_bit_exact_check_detects_a_bad_resume(tmp_path, fault):
    report = run_demo(DemoConfig(directory=tmp_path / "d", preset="quick", steps=12, save_every=4, _fault=fault))
    assert report.bit_exact is False
    assert report.mismatches


def test_demo_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("not the demo's")
    with pytest.raises(ConfigError):
        run_demo(DemoConfig(directory=tmp_path, preset="quick", steps=6))
    assert main(["demo", "--quick", "--dir", str(tmp_path)]) == 1
    assert "not created by 'tierio demo'" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").exists()


def test_demo_rerun_in_same_directory(tmp_path):
    cfg = DemoConfig(directory=tmp_path / "d", preset="quick", steps=8, save_every=3)
    assert run_demo(cfg).bit_exact
    assert run_demo(cfg).bit_exact  # old checkpoints were cleared, not restored by mistake


def test_demo_with_an_s3_archive_tier(tmp_path, s3_url):
    report = run_demo(DemoConfig(directory=tmp_path / "d", s3=s3_url, preset="quick", steps=12, save_every=4))
    assert report.bit_exact and not report.promotion_errors
    archive = report.tiers[2]
    assert archive["url"].startswith("s3://") and archive["checkpoints"] >= 1 and archive["bytes_written"] > 0


def test_demo_fails_before_training_when_the_bucket_is_missing(tmp_path, seaweed):
    from tierio.errors import StorageError

    url = seaweed.url("no-such-bucket-here/demo")
    with pytest.raises(StorageError, match="no-such-bucket-here"):
        run_demo(DemoConfig(directory=tmp_path / "d", s3=url, preset="quick", steps=12, save_every=4))
