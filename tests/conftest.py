"""Shared fixtures: a real SeaweedFS S3 server on loopback, fresh buckets, a small real tmpfs."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tierio.storage.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def seaweed():
    """One real S3 server for the whole run; its credentials are put in the environment."""
    server = SeaweedServer()
    try:
        server.start()
    except Exception as exc:  # pragma: no cover - only when the binary is missing or broken
        pytest.fail(f"could not start SeaweedFS: {exc}")
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    server.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_url(seaweed) -> str:
    """A fresh, empty bucket on the test server: 's3://bucket/prefix?endpoint=...'."""
    from tierio.storage import S3Store

    if seaweed._proc is None:  # a previous test stopped it
        seaweed.start()
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    store = S3Store(bucket, endpoint=seaweed.endpoint)
    store.create_bucket()
    # A new bucket gets its own volumes; right after a server restart the first writes can fail
    # with InternalError for a few seconds. Wait until one succeeds so tests start from a usable bucket.
    deadline = time.monotonic() + 60
    while True:
        try:
            store.put_buffers(".warmup", [b"x"])
            store.delete(".warmup")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    store.close()
    return seaweed.url(f"{bucket}/data")


def _mount(tmp_path: Path, fstype: str, options: list[str], why: str):
    mnt = tmp_path / fstype
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", fstype, *options, fstype, str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here ({r.stderr.strip() or r.returncode}); {why} untested")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 64 MiB tmpfs mount (for full-disk tests); skipped where mounting is refused."""
    yield from _mount(tmp_path, "tmpfs", ["-o", "size=64m"], "full-disk behaviour")


@pytest.fixture
def ramfs_dir(tmp_path: Path):
    """A real ramfs mount: a filesystem that refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    yield from _mount(tmp_path, "ramfs", [], "the buffered fallback")


@pytest.fixture
def readonly_dir(tmp_path: Path):
    """A real read-only mount (writes fail with EROFS even for root)."""
    yield from _mount(tmp_path, "tmpfs", ["-o", "size=1m,ro"], "writes to a read-only filesystem")
