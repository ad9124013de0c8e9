"""`tierio ckpt ls|inspect|verify|promote|gc` on real checkpoints written by CheckpointManager."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager
from tierio.cli.main import main


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16()},
        "extra": {"lr": 0.1, "name": "run"},
    }


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    """A tier holding committed steps 10, 20, 30, 40 and one uncommitted directory (step 50)."""
    root = tmp_path / "tier"
    with CheckpointManager([str(root)]) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, _state(step)).wait()
    partial = root / "step_000000050"
    partial.mkdir()
    (partial / "rank_00000.safetensors").write_bytes(b"half a shard")
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_table_and_json(tier, capsys):
    rc, out, err = run(capsys, "ckpt", "ls", str(tier))
    assert rc == 0
    for step in ("10", "20", "30", "40"):
        assert step in out
    assert "without a manifest" in err and "50" in err
    rc, out, _ = run(capsys, "ckpt", "ls", str(tier), "--json")
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20, 30, 40]
    assert doc["uncommitted"] == [50]  # never listed as a checkpoint
    assert all(c["world_size"] == 1 and c["tensors"] == 2 and c["bytes"] > 64 * 32 * 4 for c in doc["checkpoints"])


def test_inspect(tier, capsys):
    rc, out, _ = run(capsys, "ckpt", "inspect", str(tier), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 40  # latest by default
    tensors = doc["ranks"][0]["tensors"]
    assert {t["dtype"] for t in tensors.values()} == {"F32", "BF16"}
    assert sorted(t["shape"] for t in tensors.values()) == [[32], [64, 32]]
    rc, out, _ = run(capsys, "ckpt", "inspect", str(tier), "--step", "20", "--tensors")
    assert rc == 0 and "step 20" in out and "BF16" in out and "64x32" in out
    rc, _, err = run(capsys, "ckpt", "inspect", str(tier), "--step", "50")
    assert rc == 1 and "step 50" in err and "Traceback" not in err


def test_verify_detects_a_flipped_byte(tier, capsys):
    rc, out, _ = run(capsys, "ckpt", "verify", str(tier), "--json")
    assert rc == 0 and json.loads(out)["ok"] is True
    shard = tier / "step_000000030" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "ckpt", "verify", str(tier), "--step", "30", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    problem = doc["steps"][0]["problems"][0]
    assert problem["file"].endswith("step_000000030/rank_00000.safetensors")
    assert "chunk" in problem["chunk"] and "checksum mismatch" in problem["message"]
    # --all flags the bad step and the directory without a manifest, and passes the rest.
    rc, out, err = run(capsys, "ckpt", "verify", str(tier), "--all")
    assert rc == 1 and "BAD" in out and "checksum mismatch" in err and "no manifest" in err
    rc, out, _ = run(capsys, "ckpt", "verify", str(tier), "--step", "40")
    assert rc == 0


def test_promote_between_directories(tier, tmp_path, capsys):
    dst = tmp_path / "shared"
    rc, out, _ = run(capsys, "ckpt", "promote", str(tier), str(dst), "--step", "20", "--json")
    assert rc == 0 and json.loads(out)["promoted"][0]["step"] == 20
    rc, out, _ = run(capsys, "ckpt", "promote", str(tier), dst.as_uri(), "--all", "--bandwidth", "1GB")
    assert rc == 0 and "40" in out
    rc, out, _ = run(capsys, "ckpt", "ls", str(dst), "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [10, 20, 30, 40]
    assert run(capsys, "ckpt", "verify", str(dst), "--all")[0] == 0
    # The promoted copy restores bit-exact.
    with CheckpointManager([str(dst)]) as mgr:
        got = mgr.restore(30)
    assert torch.equal(got["model"]["w"], _state(30)["model"]["w"])
    assert torch.equal(got["model"]["b"], _state(30)["model"]["b"])


def test_promote_refuses_a_corrupt_copy(tier, tmp_path, capsys):
    shard = tier / "step_000000040" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    dst = tmp_path / "shared"
    rc, _, err = run(capsys, "ckpt", "promote", str(tier), str(dst))
    assert rc == 1 and "checksum mismatch" in err
    assert not (dst / "step_000000040" / "manifest.json").exists()


def test_promote_to_s3_and_back(tier, s3_url, tmp_path, capsys):
    rc, _, err = run(capsys, "ckpt", "promote", str(tier), s3_url, "--step", "40")
    assert rc == 0, err
    rc, out, _ = run(capsys, "ckpt", "ls", s3_url, "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [40]
    assert run(capsys, "ckpt", "verify", s3_url)[0] == 0
    back = tmp_path / "back"
    assert run(capsys, "ckpt", "promote", s3_url, str(back))[0] == 0
    assert (back / "step_000000040" / "rank_00000.safetensors").read_bytes() == \
        (tier / "step_000000040" / "rank_00000.safetensors").read_bytes()


def test_gc(tier, capsys):
    rc, out, _ = run(capsys, "ckpt", "gc", str(tier), "--keep", "last:2", "--min-keep", "1", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["deleted"] == [10, 20] and doc["kept"] == [30, 40]
    assert (tier / "step_000000010" / "manifest.json").exists()  # dry run deleted nothing
    # min-keep 3 overrides a policy that would keep fewer, with a warning.
    rc, out, err = run(capsys, "ckpt", "gc", str(tier), "--keep", "last:1")
    assert rc == 0 and "warning" in err
    rc, out, _ = run(capsys, "ckpt", "ls", str(tier), "--json")
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [20, 30, 40]
    assert doc["uncommitted"] == [50]  # newer than every commit: may be a save in flight, kept
    rc, out, _ = run(capsys, "ckpt", "gc", str(tier), "--keep", "every:20", "--min-keep", "0", "--json")
    assert json.loads(out)["kept"] == [20, 40]
    assert not (tier / "step_000000030").exists()


def test_errors_are_clean(tmp_path, capsys):
    rc, _, err = run(capsys, "ckpt", "ls", str(tmp_path / "missing"))
    assert rc == 1 and "does not exist" in err
    assert not (tmp_path / "missing").exists()  # reading never creates a tier
    rc, _, err = run(capsys, "ckpt", "gc", str(tmp_path), "--keep", "newest:3")
    assert rc == 1 and "retention" in err
    rc, _, err = run(capsys, "ckpt", "verify", str(tmp_path))
    assert rc == 1 and "no committed checkpoint" in err
    (tmp_path / "step_000000007").mkdir()
    (tmp_path / "step_000000007" / "manifest.json").write_text('{"schema": "tierio.checkpoint", "version": 1, "step": 7, "world_size": 1, "ranks": [{"rank": 0, "file": "../../etc/passwd", "bytes": 1, "tensors": {}, "tree": null}]}')
    rc, out, err = run(capsys, "ckpt", "inspect", str(tmp_path))
    assert rc == 1 and "not a plain name" in err
    r = subprocess.run([sys.executable, "-m", "tierio", "ckpt", "verify", str(tmp_path), "--step", "7"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a plain name" in r.stderr


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["ckpt", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "tierio ckpt gc" in out and "last:N" in out
