"""S3Store against endpoints that stall, drop connections, answer nonsense and hold hostile names.

The misbehaving endpoints (tests/faulty_endpoints.py) are real loopback servers: one accepts
connections and never answers, a proxy in front of the real SeaweedFS server stalls chosen
requests or cuts their connection part-way through the answer. pytest-timeout guards every test
that could hang.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

import boto3
import pytest
from faulty_endpoints import Fault, FaultyProxy, StalledEndpoint, first, ranged_get, via
from payloads import MiB, payload

import tierio.storage.s3 as s3mod
from tierio.errors import (
    ConfigError,
    IntegrityError,
    StoreUnavailableError,
    TierioError,
)
from tierio.storage import S3Store, open_store, read_bytes


@pytest.fixture
def stalled():
    server = StalledEndpoint()
    yield server
    server.close()


@pytest.fixture
def proxies():
    made: list[FaultyProxy] = []

    def make(upstream: str, rule, on_cut=None) -> FaultyProxy:
        made.append(FaultyProxy(upstream, rule, on_cut))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def raw(seaweed):
    """A plain boto3 client on the test server, to plant what tierio would never write."""
    return boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")


def bucket_of(s3_url: str) -> str:
    return s3_url.split("://", 1)[1].split("/", 1)[0]


# -- a stalled endpoint: every call ends with a typed error within its deadline ---------------

CALLS = {
    "list": lambda s, tmp: s.list(),
    "stat": lambda s, tmp: s.stat("k"),
    "exists": lambda s, tmp: s.exists("k"),
    "get": lambda s, tmp: s.read_into("k", 0, memoryview(bytearray(100))),
    "parallel_get": lambda s, tmp: s.read_into("k", 0, memoryview(bytearray(12 * MiB))),
    "get_file": lambda s, tmp: s.get_file("k", tmp / "out.bin"),
    "put": lambda s, tmp: s.put_buffers("k", [b"x" * 1000]),
    "multipart_put": lambda s, tmp: s.put_buffers("k", [payload(12 * MiB)]),
    "delete": lambda s, tmp: s.delete("k"),
    "create_exclusive": lambda s, tmp: s.create_exclusive("k", b"lease"),
    "cleanup": lambda s, tmp: s.cleanup(),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_stalled_endpoint_fails_typed_within_deadline(stalled, tmp_path, call, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = open_store(f"s3://bkt/run?endpoint={stalled.endpoint}&timeout=2", part_size=5 * MiB, concurrency=4)
    with pytest.raises(StoreUnavailableError, match=f"{stalled.endpoint} did not answer.*timeout=SECONDS"):
        CALLS[call](store, tmp_path)
    assert not (tmp_path / "out.bin").exists() and list(tmp_path.iterdir()) == []  # no temp file left either
    store.close()


class _Empty(http.server.BaseHTTPRequestHandler):
    """Answers every request with an empty 200: an endpoint that is not an S3 server."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_endpoint_that_is_not_s3_gives_typed_errors(tmp_path, call, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Empty)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = open_store(f"s3://bkt/run?endpoint=http://127.0.0.1:{server.server_port}&timeout=5", part_size=5 * MiB)
        try:
            CALLS[call](store, tmp_path)
        except TierioError:
            pass  # any typed error; never a KeyError or a traceback from inside boto3
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(120)
def test_ckpt_ls_on_stalled_endpoint_exits_with_error(stalled):
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-m", "tierio", "ckpt", "ls", f"s3://bkt/run?endpoint={stalled.endpoint}&timeout=2"],
                       capture_output=True, text=True, env=env, check=False, timeout=100)
    assert p.returncode == 1, p.stderr
    assert "did not answer" in p.stderr and stalled.endpoint in p.stderr and "Traceback" not in p.stderr


@pytest.mark.s3
@pytest.mark.timeout(90)
def test_stalled_parts_fail_the_whole_upload_not_each_part(seaweed, s3_url, proxies, raw):
    """Parts that never get an answer end the upload once, at its deadline: the queued parts are
    not each sent and waited for in turn, and the upload's parts are aborted afterwards."""
    proxy = proxies(seaweed.endpoint, lambda line: Fault(stall=True) if "partNumber=" in line else None)
    store = open_store(via(proxy.endpoint, s3_url, timeout=3), part_size=5 * MiB, concurrency=2)
    with pytest.raises(StoreUnavailableError, match="did not answer.*uploading part"):
        store.put_buffers("big.bin", [payload(40 * MiB)])  # 8 parts, 2 in flight
    assert len(proxy.stalled) <= 2  # only the parts in flight were sent; none retried past the deadline
    direct = open_store(s3_url)
    assert not direct.exists("big.bin")
    assert uploads(raw, direct.bucket) == ["data/big.bin"]  # no time was left to abort it ...
    assert direct.cleanup() == 1 and uploads(raw, direct.bucket) == []  # ... so cleanup does


@pytest.mark.s3
@pytest.mark.timeout(90)
def test_stalled_ranged_reads_fail_the_whole_read(seaweed, s3_url, proxies):
    open_store(s3_url).put_buffers("big.bin", [payload(20 * MiB)])
    proxy = proxies(seaweed.endpoint, lambda line: Fault(stall=True) if ranged_get(line) else None)
    store = open_store(via(proxy.endpoint, s3_url, timeout=3), part_size=5 * MiB, concurrency=2)
    with pytest.raises(StoreUnavailableError, match="did not answer.*reading"):
        store.read_into("big.bin", 0, memoryview(bytearray(20 * MiB)))
    assert len(proxy.stalled) <= 2


# -- dropped connections are retried; a short object is corruption -----------------------------


@pytest.mark.s3
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_connection_dropped_mid_body_is_retried(seaweed, s3_url, proxies, tmp_path, reset):
    data = payload(12 * MiB + 333, 3)
    open_store(s3_url).put_buffers("obj.bin", [data])
    proxy = proxies(seaweed.endpoint, first(3, ranged_get, Fault(cut_after=256 * 1024, reset=reset)))
    store = open_store(via(proxy.endpoint, s3_url), part_size=5 * MiB, concurrency=3)
    assert read_bytes(store, "obj.bin") == data
    assert len(proxy.cuts) == 3
    proxy.rule = first(2, ranged_get, Fault(cut_after=100_000, reset=reset))
    store.get_file("obj.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == data and len(proxy.cuts) == 5


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_connection_that_always_drops_is_unavailable_not_corrupt(seaweed, s3_url, proxies):
    open_store(s3_url).put_buffers("obj.bin", [payload(2 * MiB)])
    proxy = proxies(seaweed.endpoint, lambda line: Fault(cut_after=300_000) if ranged_get(line) else None)
    store = open_store(via(proxy.endpoint, s3_url), max_attempts=3)
    with pytest.raises(StoreUnavailableError, match="3 attempt"):
        read_bytes(store, "obj.bin")
    assert len(proxy.cuts) == 3


@pytest.mark.s3
def test_object_shorter_than_asked_is_integrity_error(s3_url):
    store = open_store(s3_url, part_size=5 * MiB)
    store.put_buffers("obj.bin", [payload(12 * MiB)])
    with pytest.raises(IntegrityError, match="shorter than expected"):
        store.read_into("obj.bin", 0, memoryview(bytearray(12 * MiB + 1)))  # its last range runs past the end
    with pytest.raises(IntegrityError, match="shorter than expected"):
        store.read_into("obj.bin", 13 * MiB, memoryview(bytearray(10)))  # starts past the end


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_object_replaced_between_retries_is_never_spliced(seaweed, s3_url, proxies, raw):
    old, new = payload(3 * MiB, 1), payload(3 * MiB, 2)
    store = open_store(s3_url)
    store.put_buffers("obj.bin", [old])
    full = f"{store.prefix}/obj.bin"
    proxy = proxies(seaweed.endpoint, first(1, ranged_get, Fault(cut_after=500_000)),
                    on_cut=lambda line: raw.put_object(Bucket=store.bucket, Key=full, Body=new))
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        read_bytes(open_store(via(proxy.endpoint, s3_url)), "obj.bin")


# -- endpoints that are not URLs -----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["127.0.0.1:8333", "localhost:8333", "http://h:99999", "http://h:port",
                                      "http://[::1", "ftp://h", "http://", ""])
def test_malformed_endpoint_is_config_error(endpoint, monkeypatch):
    with pytest.raises(ConfigError, match="endpoint"):
        open_store(f"s3://bkt/p?endpoint={endpoint}")
    if endpoint:
        with pytest.raises(ConfigError, match=r"http\(s\)://HOST"):
            S3Store("bkt", endpoint=endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL"):
            S3Store("bkt")


def test_bad_s3_options_are_config_errors():
    for bad in ("s3://b/p?timeout=soon", "s3://b/p?timeout=0", "s3://b/p?timeout=inf"):
        with pytest.raises(ConfigError, match="timeout"):
            open_store(bad)
    with pytest.raises(ConfigError, match="unknown S3 option"):
        S3Store("b", endpoint="http://127.0.0.1:1", colour="red")
    with pytest.raises(ConfigError, match="concurrency"):
        S3Store("b", endpoint="http://127.0.0.1:1", concurrency=0)


def test_cli_reports_malformed_endpoint_without_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-m", "tierio", "ckpt", "ls", "s3://bkt/run?endpoint=localhost:8333"],
                       capture_output=True, text=True, env=env, check=False, timeout=120)
    assert p.returncode == 1 and "http(s)://HOST" in p.stderr and "Traceback" not in p.stderr


# -- multipart uploads left behind ---------------------------------------------------------------


def uploads(raw, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.s3
def test_cleanup_aborts_stale_uploads_under_its_prefix(s3_url, raw):
    store = open_store(s3_url)
    bucket = store.bucket
    for key in ("data/step_1/a", "data/step_1/b", "data/step_2/c", "other/x"):
        up = raw.create_multipart_upload(Bucket=bucket, Key=key)
        raw.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"p" * 1000)
    assert store.cleanup(older_than=3600) == 0  # all younger than an hour: a live writer may own them
    assert store.cleanup("step_1/") == 2
    assert uploads(raw, bucket) == ["data/step_2/c", "other/x"]
    assert store.cleanup() == 1
    assert uploads(raw, bucket) == ["other/x"]  # outside the store's prefix: not its business


@pytest.mark.s3
def test_cleanup_pages_through_uploads(s3_url, raw, monkeypatch):
    monkeypatch.setattr(s3mod, "UPLOAD_PAGE", 2)  # pages of two, to page through a handful
    store = open_store(s3_url)
    for i in range(7):
        raw.create_multipart_upload(Bucket=store.bucket, Key=f"data/k{i % 3}")
    assert store.cleanup() == 7
    assert uploads(raw, store.bucket) == []


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_failed_upload_is_aborted(seaweed, s3_url, proxies, raw):
    proxy = proxies(seaweed.endpoint, lambda line: Fault(cut_after=0) if "partNumber=2 " in line else None)
    store = open_store(via(proxy.endpoint, s3_url), part_size=5 * MiB, concurrency=2, max_attempts=2)
    with pytest.raises(StoreUnavailableError, match="uploading part 2"):
        store.put_buffers("big.bin", [payload(12 * MiB)])
    assert uploads(raw, store.bucket) == [] and not open_store(s3_url).exists("big.bin")


# -- conditional create --------------------------------------------------------------------------


@pytest.mark.s3
def test_create_exclusive_has_one_winner(s3_url):
    store = open_store(s3_url)
    assert store.create_exclusive("lease", b"run-a") is True
    assert store.create_exclusive("lease", b"run-b") is False
    assert read_bytes(store, "lease") == b"run-a"
    results = list(store._pools.here().map(lambda i: store.create_exclusive("race", f"run-{i}".encode()), range(16)))
    assert results.count(True) == 1
    assert read_bytes(store, "race") == f"run-{results.index(True)}".encode()


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_create_exclusive_answer_lost_then_retried_still_wins(seaweed, s3_url, proxies):
    """The PUT lands but its answer is lost: the retry meets 412, reads the object back and
    recognises its own data."""
    # 25 bytes: "HTTP/1.1 100 Continue\r\n\r\n" passes, so the body is sent and stored; the 200 is lost.
    proxy = proxies(seaweed.endpoint, first(1, lambda line: line.startswith("PUT "), Fault(cut_after=25)))
    store = open_store(via(proxy.endpoint, s3_url))
    assert store.create_exclusive("lease", b"run-a host-1 pid-7") is True
    assert len(proxy.cuts) == 1
    assert [line.split(" ")[0] for line in proxy.requests] == ["PUT", "PUT", "GET"]  # create, 412, read back
    assert store.create_exclusive("lease", b"run-b host-2 pid-9") is False


# -- hostile listings ----------------------------------------------------------------------------


@pytest.mark.s3
def test_listing_never_hands_out_unsafe_keys(s3_url, raw):
    store = open_store(s3_url)
    store.put_buffers("step_1/ok", [b"x"])
    for key in ("data/", "data/step_1/", "data/step_2//x", "data/evil/", "/data/abs"):
        raw.put_object(Bucket=store.bucket, Key=key, Body=b"h")
    listed = {o["Key"] for o in raw.list_objects_v2(Bucket=store.bucket, Prefix="data/")["Contents"]}
    assert {"data/", "data/step_1/", "data/evil/"} <= listed  # the server keeps such names
    with pytest.warns(RuntimeWarning, match="not safe keys"):
        keys = store.list()
    assert "step_1/ok" in keys
    for key in keys:  # each is a plain relative name
        assert key and not key.startswith("/") and all(p not in ("", ".", "..") for p in key.split("/"))
    with pytest.warns(RuntimeWarning):
        assert store.list("step_1/") == ["step_1/ok"]


# -- imports -------------------------------------------------------------------------------------


def test_local_only_imports_do_not_import_boto3(tmp_path):
    code = ("import sys, tierio, tierio.storage, tierio.ckpt, tierio.weights, tierio.data\n"
            "from tierio.storage import open_store\n"
            "open_store(sys.argv[1]).list()\n"
            "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'boto3 imported'\n"
            "from tierio.storage import S3Store\n"
            "assert S3Store.__name__ == 'S3Store' and 'boto3' in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, env=env, check=False, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_multipart_completion_answer_lost_then_retried_succeeds(seaweed, s3_url, proxies):
    data = payload(12 * MiB, 5)

    def completes(line: str) -> bool:
        return line.startswith("POST ") and "uploadId=" in line

    proxy = proxies(seaweed.endpoint, first(1, completes, Fault(cut_after=0)))
    store = open_store(via(proxy.endpoint, s3_url), part_size=5 * MiB)
    assert store.put_buffers("big.bin", [data]) == len(data)
    assert [line.split(" ")[0] for line in proxy.requests].count("POST") == 3  # start, complete, complete again
    assert len(proxy.cuts) == 1
    assert read_bytes(open_store(s3_url), "big.bin") == data
