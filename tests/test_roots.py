"""Stores and caches stay inside their roots, even while someone swaps a directory for a link
(issue 25, items 9, 10 and 12).

The race of LocalStore (issue 25, item 10) is made real: a second process exchanges a directory
under the store's root with a symbolic link to an outside directory (renameat2 RENAME_EXCHANGE,
so the name always exists) as fast as it can, while this process writes, deletes, prunes and
cleans up under that name. Nothing outside the root may ever change.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tierio.errors import ConfigError, TierioError
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache, entry_name
from tierio.storage.local import LocalStore
from tierio.weights import WeightCache

_SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b, stop = (p.encode() for p in sys.argv[1:4])
n = 0
while not os.path.exists(stop) or n % 2:
    if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        if ctypes.get_errno() == 2 and not os.path.lexists(a):  # the store pruned the emptied real directory
            os.makedirs(a, exist_ok=True)
            continue
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
    n += 1
    if n == 1:
        open(stop + b".started", "w").close()
"""


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``d`` with its (mode, size): what must not change."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(d))] = (st.st_mode, st.st_size)
    return out


def _exchange_supported(tmp: Path) -> bool:
    import ctypes

    tmp.mkdir()
    (tmp / "x").mkdir()
    (tmp / "y").symlink_to(tmp)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.renameat2(-100, str(tmp / "x").encode(), -100, str(tmp / "y").encode(), 2) == 0


def test_local_store_writes_deletes_and_cleanup_stay_inside_while_a_directory_is_swapped(tmp_path):
    if not _exchange_supported(tmp_path / "probe"):
        pytest.skip("this filesystem has no RENAME_EXCHANGE")
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "sub").mkdir()  # an empty directory a prune through the link would remove
    (outside / "sub" / ".victim.tmp-000000000000").write_bytes(b"secret")  # what cleanup must not unlink
    (outside / ".victim.tmp-000000000000").write_bytes(b"secret")
    os.utime(outside / ".victim.tmp-000000000000", (0, 0))
    os.utime(outside / "sub" / ".victim.tmp-000000000000", (0, 0))
    (outside / "empty").mkdir()
    (root / "lnk").symlink_to(outside)
    before = _tree(outside)
    store = LocalStore(root, direct=False)
    src = tmp_path / "src"
    src.write_bytes(b"y" * 10)
    stop = tmp_path / "stop"
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(root / "a"), str(root / "lnk"), str(stop)])
    try:
        while not Path(f"{stop}.started").exists():
            assert swapper.poll() is None, "the swapper process ended early"
        for i in range(1500):
            for op in (lambda: store.put_buffers("a/sub/k", [b"x" * 100]),
                       lambda: store.put_file("a/sub/f", src),
                       lambda: store.delete("a/sub/k"),
                       lambda: store.delete("a/empty/none"),
                       lambda: store.cleanup("a/"),
                       lambda: store.delete_prefix("a/empty/")):
                try:
                    op()
                except TierioError:
                    pass  # the link was there at the check: refused, which is right
            assert _tree(outside) == before, f"iteration {i}: something outside the store's root changed"
    finally:
        stop.touch()
        swapper.wait(timeout=60)
    assert swapper.returncode == 0
    assert _tree(outside) == before


# -- the weight cache copies what a load needs, within its limit, never a link's target -------------
def _model(d: Path, rows: int = 16) -> dict[str, torch.Tensor]:
    d.mkdir(parents=True)
    ref = {f"l{i}.w": torch.full((rows, 256), float(i)) for i in range(2)}
    wm = {}
    for i, (k, t) in enumerate(ref.items()):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: t}, str(d / name))
        wm[k] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (d / "config.json").write_text('{"model_type": "test"}')
    return ref


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if not p.is_dir())


def test_weight_cache_copies_only_allowed_companions_within_its_limit_and_no_link(tmp_path, caplog):
    m = tmp_path / "m"
    ref = _model(m)
    (m / "tokenizer.json").write_text('{"version": "1.0"}')
    (m / "optimizer.pt").write_bytes(os.urandom(8 << 20))  # not something a load reads
    (m / "notes").mkdir()
    (m / "notes" / "config.json").write_text("{}")  # allowed name, but not beside the shards
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = AKIAEXAMPLESECRET\n")
    (m / "tokenizer_config.json").symlink_to(secret)  # planted in a shared model directory
    cache = WeightCache(tmp_path / "cache", 1 << 20)
    with caplog.at_level(logging.WARNING, logger="tierio.weights.cache"):
        out = cache.load(m)
    assert sorted(out) == sorted(ref) and all(torch.equal(out[k], ref[k]) for k in ref)
    entry = cache.entries()[0].path
    assert _files(entry) == sorted([".tierio-cache.json", "config.json", "model.safetensors.index.json", "tokenizer.json",
                                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert cache.usage() <= 1 << 20
    assert "tokenizer_config.json" in caplog.text and "symbolic link" in caplog.text
    for p in (tmp_path / "cache").rglob("*"):
        assert p.is_dir() or b"AKIAEXAMPLESECRET" not in p.read_bytes(), p
    assert torch.equal(cache.load(m)["l1.w"], ref["l1.w"])  # the copy is a usable hit


def test_weight_cache_reserves_room_for_its_companion_files(tmp_path):
    m = tmp_path / "m"
    _model(m, rows=512)  # two 512 KiB shards: they alone fit the limit
    (m / "tokenizer.json").write_bytes(b"{" + b" " * (600 << 10) + b"}")
    cache = WeightCache(tmp_path / "cache", (1 << 20) + (64 << 10))
    with pytest.raises(ConfigError, match="needs .* bytes but the cache .* holds at most"):
        cache.fetch(m)
    assert cache.usage() == 0


# -- what an entry holds is on the disk before the entry is published ------------------------------
@pytest.fixture
def syscalls(monkeypatch) -> list[tuple[str, object]]:
    """Every fsync (as the synced file's device and inode) and rename (as its target name), in order.
    The real calls still run: this records, it changes nothing."""
    seen: list[tuple[str, object]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        seen.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def rename(src, dst, *args, **kw):
        seen.append(("rename", os.fspath(dst)))
        return real_rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return seen


def _synced_before_publish(seen: list[tuple[str, object]], name: str) -> set[object]:
    at = seen.index(("rename", name))
    return {x for op, x in seen[:at] if op == "fsync"}


def _ino(p: Path) -> tuple[int, int]:
    st = p.lstat()
    return st.st_dev, st.st_ino


def test_weight_cache_record_and_companions_are_synced_before_the_entry_is_published(tmp_path, syscalls):
    m = tmp_path / "m"
    _model(m)
    (m / "tokenizer.json").write_text("{}")
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    cache.fetch(m)
    synced = _synced_before_publish(syscalls, cache.entry_name(m))
    entry = cache.entries()[0].path
    for p in [entry, *entry.rglob("*")]:
        assert _ino(p) in synced, f"{p.name} was not fsynced before its entry was published"


def test_unsynced_marker_is_durable_before_the_commit_that_depends_on_it(tmp_path, syscalls):
    node = NodeCache(tmp_path / "c", CacheOptions(limit=1 << 20, name="t"))
    plan = FillPlan(3, lambda target: target.write_bytes(b"abc"), "a test entry", durable=False)
    with node.get("k", "file", lambda: plan) as pin:
        assert not pin.hit
    synced = _synced_before_publish(syscalls, entry_name("k"))
    assert _ino(tmp_path / "c" / "unsynced") in synced  # the marker's name
    assert _ino(tmp_path / "c") in synced  # unsynced/ itself, made by this fill
