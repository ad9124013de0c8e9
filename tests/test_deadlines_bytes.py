"""Deadlines that hold on every byte: an S3 body that keeps arriving, a byte at a time under the
read timeout, still ends within its call's deadline (or its request's size over ``min_rate``).

The dripping endpoint is a real loopback proxy in front of the real SeaweedFS server
(tests/faulty_endpoints.py): it forwards the answer's headers and then the body one byte at a
time. pytest-timeout guards every test that could read on for ever.
"""

from __future__ import annotations

import time

import pytest
from faulty_endpoints import Fault, FaultyProxy, first, ranged_get, via
from payloads import MiB, payload

from tierio.errors import ConfigError, StoreUnavailableError
from tierio.storage import S3Store, open_store, read_bytes

DRIP = 0.02  # seconds per byte: 50 B/s, so even 4 KiB would take 80 s

READS = {
    "get": lambda s, tmp: s.read_into("obj.bin", 0, memoryview(bytearray(4096))),
    "parallel_get": lambda s, tmp: s.read_into("obj.bin", 0, memoryview(bytearray(12 * MiB))),
    "get_file": lambda s, tmp: s.get_file("obj.bin", tmp / "out.bin"),
    "read_small": lambda s, tmp: s.read_small("obj.bin", 4096),  # how a lease is read
}


@pytest.fixture
def proxies():
    made: list[FaultyProxy] = []

    def make(upstream: str, rule) -> FaultyProxy:
        made.append(FaultyProxy(upstream, rule))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.s3
@pytest.mark.timeout(40)
@pytest.mark.parametrize("call", sorted(READS))
def test_a_dripping_body_ends_with_a_typed_error_at_the_deadline(seaweed, s3_url, proxies, tmp_path, call):
    """Before: the read went on at 50 B/s for as long as the body lasted (days for 12 MiB)."""
    open_store(s3_url).put_buffers("obj.bin", [payload(12 * MiB)])
    proxy = proxies(seaweed.endpoint, lambda line: Fault(drip=DRIP) if ranged_get(line) else None)
    store = open_store(via(proxy.endpoint, s3_url, timeout=3), part_size=5 * MiB, concurrency=3)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"(?s)did not answer in time while reading.*deadline ran out"):
        READS[call](store, tmp_path)
    assert time.monotonic() - started < 15  # it ended (generous: the body would drip for days)
    assert not (tmp_path / "out.bin").exists() and list(tmp_path.iterdir()) == []  # no temp file left
    store.close()


@pytest.mark.s3
@pytest.mark.timeout(40)
def test_a_body_slower_than_min_rate_is_cut_and_its_rest_asked_again(seaweed, s3_url, proxies):
    """One request may take its size over ``min_rate`` (plus one attempt's timeouts): the first,
    dripping answer is cut there, and the rest of the range comes from a second request, so the
    read succeeds well inside the call's 60 s deadline."""
    data = payload(64 * 1024, 7)
    open_store(s3_url).put_buffers("obj.bin", [data])
    proxy = proxies(seaweed.endpoint, first(1, ranged_get, Fault(drip=0.001)))
    store = open_store(via(proxy.endpoint, s3_url), min_rate=64 * 1024, connect_timeout=1, read_timeout=1)
    assert store.options.request_seconds(len(data)) == pytest.approx(4.0)  # 1 + 1 (Expect) + 1 + 64 KiB / 64 KiB/s
    assert read_bytes(store, "obj.bin") == data
    assert len([line for line in proxy.requests if ranged_get(line)]) == 2
    store.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_min_rate_must_be_a_positive_rate(bad):
    with pytest.raises(ConfigError, match="min_rate=.*bytes per second"):
        S3Store("bkt", endpoint="http://127.0.0.1:1", min_rate=bad)
