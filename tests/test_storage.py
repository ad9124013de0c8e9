"""Stores on real directories and a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import threading
import time

import pytest
from payloads import MiB, payload

from tierio.errors import (
    AuthError,
    BucketNotFoundError,
    ConfigError,
    DiskFullError,
    NotFoundError,
    StorageError,
    StoreUnavailableError,
)
from tierio.storage import LocalStore, S3Store, open_store, read_bytes
from tierio.storage.seaweed import free_port


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "tier")
    url = request.getfixturevalue("s3_url")
    return open_store(url, part_size=5 * MiB, concurrency=4)


def test_round_trip_and_listing(store, tmp_path):
    data = payload(12 * MiB + 333)  # several multipart parts and an odd tail
    assert store.put_buffers("a/b/data.bin", [data[:1000], data[1000:]]) == len(data)
    assert store.exists("a/b/data.bin") and not store.exists("a/b/other")
    assert store.stat("a/b/data.bin").size == len(data)
    assert read_bytes(store, "a/b/data.bin") == data
    buf = bytearray(5 * MiB + 7)
    store.read_into("a/b/data.bin", 3 * MiB + 1, memoryview(buf))  # ranged read across parts
    assert bytes(buf) == data[3 * MiB + 1 : 8 * MiB + 8]
    src = tmp_path / "src.bin"
    src.write_bytes(data[:7 * MiB])
    store.put_file("c/file.bin", src)
    store.get_file("c/file.bin", tmp_path / "back" / "file.bin")
    assert (tmp_path / "back" / "file.bin").read_bytes() == data[:7 * MiB]
    store.put_buffers("a/x", [b""])
    assert store.list("a/") == ["a/b/data.bin", "a/x"]
    assert store.list() == ["a/b/data.bin", "a/x", "c/file.bin"]
    store.delete("a/x")
    store.delete("a/x")  # deleting a missing key is not an error
    assert store.list("a") == ["a/b/data.bin"]


def test_missing_key_is_typed(store):
    with pytest.raises(NotFoundError, match="missing"):
        store.stat("missing")
    with pytest.raises(NotFoundError, match="missing"):
        store.read_into("missing", 0, memoryview(bytearray(4)))


def test_keys_cannot_escape(store):
    for bad in ["../x", "/etc/passwd", "a/../../b", "", "a//b"]:
        with pytest.raises(ConfigError):
            store.put_buffers(bad, [b"x"])


def test_local_listing_hides_temp_files(tmp_path):
    s = LocalStore(tmp_path)
    s.put_buffers("k", [b"1"])
    (tmp_path / ".k.tmp-123").write_bytes(b"partial")
    assert s.list() == ["k"]


def test_local_full_disk_leaves_nothing(small_tmpfs):
    s = LocalStore(small_tmpfs / "tier")
    s.put_buffers("keep", [b"good"])
    with pytest.raises(DiskFullError, match="no space"):
        s.put_buffers("big", [payload(MiB)] * 70)
    assert s.list() == ["keep"] and read_bytes(s, "keep") == b"good"


def test_open_store_urls(tmp_path, seaweed):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path
    s3 = open_store(f"s3://bkt/pre/fix?endpoint={seaweed.endpoint}")
    assert isinstance(s3, S3Store) and s3.bucket == "bkt" and s3.prefix == "pre/fix"
    with pytest.raises(ConfigError):
        open_store("ftp://x/y")
    with pytest.raises(ConfigError):
        open_store("s3://b/p?colour=red")


@pytest.mark.s3
def test_s3_lists_past_one_thousand_keys(s3_url):
    s = open_store(s3_url, concurrency=16)
    keys = [f"many/{i:05d}" for i in range(1100)]
    list(s._pools.here().map(lambda k: s.put_buffers(k, [b"x"]), keys))
    assert s.list("many/") == keys


@pytest.mark.s3
def test_s3_missing_bucket_and_bad_credentials(seaweed, monkeypatch):
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        S3Store("no-such-bucket", endpoint=seaweed.endpoint).list()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(AuthError, match="credentials"):
        S3Store("any", endpoint=seaweed.endpoint).list()


def test_s3_dead_endpoint_is_typed(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")  # signed requests get as far as connecting
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    s = S3Store("b", endpoint=f"http://127.0.0.1:{free_port()}", max_attempts=1)
    with pytest.raises(StoreUnavailableError, match="refused the connection.*check that the S3 server is running"):
        s.put_buffers("k", [b"x"])
    with pytest.raises(StoreUnavailableError):
        s.list()


@pytest.mark.s3
def test_s3_server_stopped_mid_upload_leaves_no_object(seaweed, s3_url):
    s = open_store(s3_url, part_size=5 * MiB, concurrency=1, max_attempts=1)
    data = payload(40 * MiB, 9)
    killer = threading.Timer(0.3, seaweed.stop)
    killer.start()
    try:
        with pytest.raises(StorageError):
            for i in range(50):  # keep uploading until the server dies under us
                s.put_buffers("big.bin", [data])
                s.delete("big.bin")
    finally:
        killer.join()
        seaweed.start()
    s2 = open_store(s3_url)
    deadline = time.monotonic() + 30
    while True:
        try:
            keys = s2.list()
            break
        except StorageError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert "big.bin" not in keys
    s2.cleanup()  # whatever upload the dead server kept is aborted now that it is back
    assert s2.client.list_multipart_uploads(Bucket=s2.bucket).get("Uploads", []) == []


def _create_big(root: str, n: int) -> None:
    LocalStore(root, direct=False).create_exclusive("lease", b"x" * n)


def test_create_exclusive_killed_mid_write_leaves_no_torn_file(tmp_path):
    """A writer killed while writing leaves the name free (a temp file at most), never an empty
    or partial file that every later writer would have to wait out or read as corrupt."""
    import multiprocessing as mp
    import os
    import signal

    root = tmp_path / "tier"
    root.mkdir()
    p = mp.get_context("spawn").Process(target=_create_big, args=(str(root), 256 << 20))
    p.start()
    deadline = time.monotonic() + 120
    while not any(f.stat().st_size > 0 for f in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.001)  # until some bytes are on the disk: the write is under way
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    store = LocalStore(root)
    assert not store.exists("lease")
    assert store.create_exclusive("lease", b"run-b") is True
    assert read_bytes(store, "lease") == b"run-b"
    assert store.create_exclusive("lease", b"run-c") is False
    store.cleanup(older_than=0.0)  # the killed writer's temp is garbage: its lock died with it
    assert [f.name for f in root.iterdir()] == ["lease"]


def test_a_seaweed_port_taken_before_the_first_start_is_replaced(tmp_path):
    """Another process may take a chosen port before the server binds it: the first start tries
    again on new ports (a restart keeps its own)."""
    import socket

    from tierio.storage.seaweed import SeaweedServer

    server = SeaweedServer(tmp_path / "weed")
    taken = server.ports["s3.iceberg"]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.ports["s3.iceberg"] != taken
            assert b"address already in use" in (tmp_path / "weed" / "weed.log").read_bytes()
            server.stop()
            ports = dict(server.ports)
            server.start()  # a restart: the same ports
            assert server.ports == ports
        finally:
            server.stop()
