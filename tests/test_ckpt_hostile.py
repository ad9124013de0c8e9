"""Hostile and damaged input around checkpoints: links planted in a tier are never followed (no
restore from an outside file, no deletion through a link), damaged leases and lineage fields are
typed errors, and a stalled slower tier never blocks construction or a save."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager, KeepLast, Tier, delete_step, gc, list_checkpoints
from tierio.ckpt.steps.lease import LEASE_PREFIX, newest_generation, read_lease
from tierio.cli.main import main
from tierio.errors import ConfigError, FormatError, IntegrityError, LeaseError, NotFoundError, TierioError
from tierio.storage import open_store

STEP2 = "step_000000002"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8 * 1024, generator=g), "step": step}


def two_tiers(tmp_path: Path) -> list[str]:
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    with CheckpointManager(tiers) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step)).wait()
    return tiers


def outside_copy(tmp_path: Path, src: Path) -> Path:
    """A valid copy of ``src`` outside every tier (what a link would lead to)."""
    dst = tmp_path / "elsewhere" / src.name
    dst.parent.mkdir(exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def test_symlinked_shard_is_not_restored_from(tmp_path):
    fast, slow = two_tiers(tmp_path)
    shard = Path(fast) / STEP2 / "rank_00000.safetensors"
    target = outside_copy(tmp_path, shard)
    shard.unlink()
    shard.symlink_to(target)  # byte-identical: following the link would "work"
    with CheckpointManager([fast, slow]) as mgr:
        with pytest.warns(UserWarning, match="symbolic link"):
            out = mgr.restore()
        assert mgr.restored_step == 2 and mgr.restored_from == open_store(slow).url
        assert torch.equal(out["w"], state(2)["w"])
    with CheckpointManager([fast]) as mgr:  # no other copy of step 2: the older step, never the link
        with pytest.warns(UserWarning):
            mgr.restore()
        assert mgr.restored_step == 1
        with pytest.raises(IntegrityError, match="symbolic link"):
            mgr.restore(2)


def test_symlinked_manifest_and_step_directory_are_not_checkpoints(tmp_path, capsys):
    fast, slow = two_tiers(tmp_path)
    manifest = Path(fast) / STEP2 / "manifest.json"
    target = outside_copy(tmp_path, manifest)
    manifest.unlink()
    manifest.symlink_to(target)
    assert [c.step for c in list_checkpoints(fast)] == [1]
    with CheckpointManager([fast, slow]) as mgr:
        mgr.restore(2)
        assert mgr.restored_from == open_store(slow).url
    # A step directory that is a link (to a complete, valid checkpoint elsewhere) is not listed either.
    step_dir = Path(slow) / STEP2
    outside = outside_copy(tmp_path, step_dir)
    shutil.rmtree(step_dir)
    step_dir.symlink_to(outside, target_is_directory=True)
    assert [c.step for c in list_checkpoints(slow)] == [1]
    with CheckpointManager([slow]) as mgr:
        assert mgr.steps() == [1]
        with pytest.raises((NotFoundError, IntegrityError)):
            mgr.restore(2)
    assert main(["ckpt", "verify", slow, "--step", "2"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_nothing_is_deleted_through_a_link(tmp_path):
    fast, slow = two_tiers(tmp_path)
    with CheckpointManager([fast]) as mgr:
        for step in (3, 4, 5):
            mgr.save(step, state(step)).wait()
    # step 1's directory becomes a link to a checkpoint outside; step 2's shard a link to an outside file
    outside_dir = outside_copy(tmp_path, Path(fast) / "step_000000001")
    shutil.rmtree(Path(fast) / "step_000000001")
    (Path(fast) / "step_000000001").symlink_to(outside_dir, target_is_directory=True)
    shard = Path(fast) / STEP2 / "rank_00000.safetensors"
    outside_file = outside_copy(tmp_path, shard)
    shard.unlink()
    shard.symlink_to(outside_file)
    before = {p: p.read_bytes() for p in [outside_file, *outside_dir.iterdir()]}
    # Step 1 (a linked directory) is not a checkpoint; step 2's manifest is, its linked shard is not a key.
    assert gc(fast, "last:1", min_keep=1) == [2, 3, 4]
    delete_step(open_store(fast), 1)
    assert main(["ckpt", "gc", fast, "--keep", "last:1", "--min-keep", "0"]) == 0
    with CheckpointManager([Tier(fast, KeepLast(1))], min_keep=1) as mgr:
        mgr.restore(5)
        mgr.save(6, state(6)).wait()  # rollback retirement, retention and clean-up all run here
        assert mgr.steps() == [6]
    assert {p: p.read_bytes() for p in before} == before
    assert (Path(fast) / "step_000000001").is_symlink() and shard.is_symlink()  # only links of ours go


def test_planted_lease_link_and_garbage_lease(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIERIO_LEASE_EXPIRES", "1")
    root = tmp_path / "tier"
    (root / LEASE_PREFIX).mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = root / LEASE_PREFIX / "000000000001.json"
    planted.symlink_to(victim)
    with CheckpointManager([root]) as mgr:
        with pytest.raises(LeaseError, match=r"000000000001.json is not a lease.*remove it by hand"):
            mgr.save(1, state(1)).wait()  # the link is neither read through nor removed
    assert victim.read_text() == "precious" and planted.is_symlink()
    planted.unlink()
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
    assert read_lease(open_store(root)) is None  # released
    for garbage in (b"{" * 10000, b'{"schema": "tierio.lease", "version": 2, "run": "../x", "pid": 1e400}', b"\xff\xfe"):
        bad = root / LEASE_PREFIX / f"{newest_generation(open_store(root)) + 1:012d}.json"
        bad.write_bytes(garbage)
        with pytest.raises(FormatError):
            read_lease(open_store(root))
        assert main(["ckpt", "ls", str(root), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["lease"]["stale"] == "unreadable" and [c["step"] for c in doc["checkpoints"]] == [1]
        assert main(["ckpt", "unlock", str(root)]) == 0  # unchanged while it watched: broken
        assert "unreadable" in capsys.readouterr().out and read_lease(open_store(root)) is None
    # The lease directory itself planted as a link out of the tier: refused, nothing written there.
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / LEASE_PREFIX).rename(tmp_path / "old-lease")
    (root / LEASE_PREFIX.rstrip("/")).symlink_to(outside)
    with CheckpointManager([root]) as mgr:
        with pytest.raises(TierioError):
            mgr.save(2, state(2)).wait()
    assert list(outside.iterdir()) == [] and victim.read_text() == "precious"


def test_hostile_lineage_fields_are_reported_not_raised(tmp_path, capsys):
    root = tmp_path / "tier"
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
        mgr.save(2, state(2)).wait()
    path = root / "step_000000002" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["extra"]["tierio.run"] = ["not", "a", "string"]
    path.write_text(json.dumps(doc))
    infos = list_checkpoints(root)
    assert infos[0].run is not None and infos[0].error is None
    assert infos[1].error is not None and "tierio.run" in infos[1].error
    assert main(["ckpt", "ls", str(root)]) == 0
    assert "unreadable manifest" in capsys.readouterr().err
    # The save's reason ("emergency: SIGTERM"): a string of at most 128 characters, or unreadable.
    for bad in ({"signal": 15}, "x" * 129):
        doc["extra"] = {"tierio.run": "r1", "tierio.reason": bad}
        path.write_text(json.dumps(doc))
        infos = list_checkpoints(root)
        assert infos[1].reason is None and infos[1].error is not None and "tierio.reason" in infos[1].error
    with CheckpointManager([tmp_path / "other"]) as mgr, pytest.raises(ConfigError, match="reason"):
        mgr.save(1, state(1), reason="x" * 129)  # refused before anything is written


def test_constructor_and_save_never_wait_on_a_stalled_tier(tmp_path, monkeypatch):
    """A slower tier that accepts connections and never answers must not block construction."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")  # so that requests really go out (and stall)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    released = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not released.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)  # never answered
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    # A watchdog ends the stall long after any reasonable construction; the test checks it never had to.
    watchdog = threading.Timer(300, released.set)
    watchdog.start()
    from tierio.storage.s3 import S3Store

    stalled = S3Store("stalled", "run", endpoint=f"http://127.0.0.1:{port}", max_attempts=1)  # fails fast once released
    try:
        mgr = CheckpointManager([tmp_path / "nvme", stalled])
        constructed_while_stalled = not released.is_set()
        h = mgr.save(1, state(1))
        h.persisted.result()  # tier 0 does not wait on the stalled tier either
        assert mgr.restore(1)["step"] == 1
        persisted_while_stalled = not released.is_set()
    finally:
        released.set()
        watchdog.cancel()
        for c in held:
            c.close()
        server.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.close()
    assert constructed_while_stalled and persisted_while_stalled
    assert os.listdir(tmp_path / "nvme")
