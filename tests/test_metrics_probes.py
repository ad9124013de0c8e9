"""The metrics endpoint against a hung mount and credentials in tier URLs.

The hung mount is real: a FUSE filesystem whose daemon never answers (the kernel's FUSE_INIT is
left unread), so statvfs on it blocks as it does on an NFS mount whose server is gone. Scrapes go
over loopback to the real endpoint."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

pytest.importorskip("prometheus_client")
from metrics_scrape import scrape_text  # noqa: E402

from tierio import events, metrics  # noqa: E402


@pytest.fixture
def hung_mount(tmp_path):
    """A directory on which statvfs blocks until the fixture ends (then it fails with ENOTCONN)."""
    mnt = tmp_path / "hung"
    mnt.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        pytest.skip(f"no /dev/fuse here ({exc}); the hung-mount probe is untested")
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if libc.mount(b"tierio-hung", str(mnt).encode(), b"fuse", 0, opts) != 0:
        os.close(fd)
        pytest.skip(f"cannot mount FUSE here ({os.strerror(ctypes.get_errno())}); the hung-mount probe is untested")
    try:
        yield mnt
    finally:
        os.close(fd)  # aborts the connection: every statvfs still waiting fails now
        libc.umount2(str(mnt).encode(), 2)  # MNT_DETACH


def probes() -> int:
    return sum(t.name == "tierio-metrics-statvfs" for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_a_hung_mount_does_not_hang_scrapes_nor_pile_up_threads(tmp_path, hung_mount):
    """Before: the scrape ran statvfs itself and never answered; each new scrape left one more
    thread stuck on the mount."""
    ok = tmp_path / "ok"
    ok.mkdir()
    with metrics.serve(0) as ex:
        events.emit(events.CheckpointRestored(1, str(hung_mount), 0.1))
        events.emit(events.CheckpointRestored(1, str(ok), 0.1))
        for _ in range(3):
            _, got = scrape_text(ex.port)  # each answers, after at most PROBE_WAIT for the hung tier
            assert got["tierio_tier_free_bytes"][(("tier", str(ok)),)] > 0
            assert got["tierio_tier_space_age_seconds"][(("tier", str(ok)),)] == 0
            assert (("tier", str(hung_mount)),) not in got["tierio_tier_free_bytes"]  # never read
            assert got["tierio_tier_space_age_seconds"][(("tier", str(hung_mount)),)] > 0  # and says so
        assert probes() == 1  # one probe stuck on the hung mount, not one per scrape


@pytest.mark.timeout(30)
def test_tier_labels_never_carry_credentials(tmp_path):
    """Before: a tier URL was a label as it was, user:password included, for anyone who scrapes."""
    url = "s3://bkt/run?endpoint=http://AKIAEXAMPLE:hunter2@127.0.0.1:9000"
    with metrics.serve(0) as ex:
        events.emit(events.CheckpointRestored(1, url, 0.5))
        events.emit(events.PromotionFailed(1, url, "test", False))
        text, got = scrape_text(ex.port)
    assert "hunter2" not in text and "AKIAEXAMPLE" not in text
    assert (("tier", "s3://bkt/run?endpoint=http://127.0.0.1:9000"),) in got["tierio_checkpoint_restore_seconds_count"]
