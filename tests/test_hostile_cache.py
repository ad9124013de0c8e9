"""Hostile and damaged input against the shard cache and the weight cache: nothing outside the cache
directory is ever created, truncated or deleted, bogus sizes are format errors, damaged records are
misses, and a streaming reader never waits on its own pins."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import threading
from email.utils import formatdate
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tierio.data.cache import ShardCache
from tierio.data.shards import ShardWriter
from tierio.data.streaming import StreamingDataset
from tierio.errors import FormatError, IntegrityError
from tierio.storage import open_store
from tierio.weights import LoadStats, WeightCache

N = 400


def _write(url: str, n: int = N, shard_size: int = 16384, format: str = "tar"):
    with ShardWriter(url, ["x", "pad"], shard_bytes=shard_size, format=format) as w:
        for i in range(n):
            w.write({"x": np.array([i, (i * i) % 97], np.int64), "pad": np.zeros(16, np.uint8)})
    return w.manifest


def _ids(ds) -> list[int]:
    return [int(s["x"][0]) for s in ds]


def _files(root: Path, skip: Path | None = None) -> set[str]:
    """Every path under ``root`` (links included, not followed), except those under ``skip``."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if skip is None or (p != skip and skip not in p.parents):
                out.add(str(p.relative_to(root)))
    return out


# -- the shard cache ---------------------------------------------------------------------------
def test_index_json_xxh3_naming_a_path_touches_nothing_outside_the_cache(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    _write(url)
    index = tmp_path / "remote" / "index.json"
    doc = json.loads(index.read_text())
    doc["shards"][0]["xxh3"] = "../../victim"
    index.write_text(json.dumps(doc))
    cache_dir = tmp_path / "deep" / "cache"
    victim = tmp_path / "victim-shard-000000.tar"  # where cache_dir/../../victim-<key> used to land
    victim.write_bytes(b"precious")
    (tmp_path / "deep").mkdir()
    before = _files(tmp_path, skip=cache_dir)
    with pytest.raises((FormatError, IntegrityError)):
        _ids(StreamingDataset(url, cache_dir, "4MiB", shuffle=False, prefetch=0))
    assert victim.read_bytes() == b"precious"  # a size mismatch never deletes outside the cache
    assert _files(tmp_path, skip=cache_dir) == before  # no lock, partial or reservation outside it


def test_shard_cache_names_its_files_itself(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    man = _write(url)
    victim = tmp_path / "victim-shard-000000.tar"
    victim.write_bytes(b"precious")
    (tmp_path / "deep").mkdir()
    cache_dir = tmp_path / "deep" / "cache"
    cache = ShardCache(open_store(url), cache_dir, 1 << 20)
    before = _files(tmp_path, skip=cache_dir)
    for bad in ("../../victim", "/abs/victim", "a/../../../victim"):
        with pytest.raises((FormatError, IntegrityError)):
            cache.ensure(dataclasses.replace(man.shards[0], xxh3=bad))
    assert victim.read_bytes() == b"precious"
    assert _files(tmp_path, skip=cache_dir) == before


@pytest.mark.parametrize("size", [float("nan"), float("inf"), -1, 1.5])
def test_bogus_shard_size_is_a_format_error_and_evicts_nothing(tmp_path, size):
    url = f"file://{tmp_path / 'remote'}"
    man = _write(url)
    cache = ShardCache(open_store(url), tmp_path / "cache", 3 * man.max_shard_size, wait_timeout=0.5)
    kept = [cache.ensure(info) for info in man.shards[:3]]
    with pytest.raises(FormatError, match="size"):
        cache.ensure(dataclasses.replace(man.shards[3], size=size))
    assert all(p.exists() for p in kept)  # make-room never ran on the bogus size


@pytest.mark.parametrize("shards_in_limit", [1, 2, 3, 4])
def test_a_reader_never_waits_on_its_own_pins(tmp_path, shards_in_limit):
    url = f"file://{tmp_path / 'remote'}"
    man = _write(url)
    assert len(man.shards) > 8
    ds = StreamingDataset(url, tmp_path / "cache", shards_in_limit * man.max_shard_size, seed=0, shuffle_buffer=64,
                          max_open_shards=4, prefetch=2, wait_timeout=1.0)
    assert sorted(_ids(ds)) == list(range(N))
    assert ds.cache.usage()[0] <= shards_in_limit * man.max_shard_size


# -- the weight cache --------------------------------------------------------------------------
def _model(d: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    ref = {"l0.w": torch.randn(64, 100), "l0.b": torch.randn(7)}
    save_file(ref, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return ref


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_planted_lock_link_creates_nothing_outside_the_weight_cache(tmp_path):
    _model(tmp_path / "m")
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache" / "locks" / f"{cache.entry_name(str(tmp_path / 'm'))}.lock").symlink_to(outside / "created")
    cache.fetch(str(tmp_path / "m"))
    assert list(outside.iterdir()) == []


def test_manifest_naming_files_outside_the_model_writes_nothing_outside_the_entry(tmp_path):
    # a checkpoint-shaped directory whose manifest names a shard through '..'
    ref = _model(tmp_path / "outside")
    m = tmp_path / "m"
    m.mkdir()
    (m / "manifest.json").write_text(json.dumps({"format": "x", "chunks": [{"file": "../outside/model.safetensors"}]}))
    before = (tmp_path / "outside" / "model.safetensors").read_bytes()
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(FormatError):
        cache.fetch(str(m))
    assert (tmp_path / "outside" / "model.safetensors").read_bytes() == before  # never truncated
    assert list((tmp_path / "cache" / "entries").iterdir()) == []  # no other entry written into
    assert ref


def test_damaged_record_is_a_miss_and_refetched(tmp_path):
    ref = _model(tmp_path / "m")
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    cache.fetch(str(tmp_path / "m"))
    record = cache.entries()[0].path / ".tierio-cache.json"
    damages = [b"[" * 100_000, b'{"version": 1, "files": {"a": {"size": 1' + b"0" * 5000 + b"}}}", b"\xff\xfe", b"",
               b'{"version": 1, "source": "x", "kind": "dir", "files": {"/etc/passwd": {"size": 1}}, "files_order": ["/etc/passwd"], "chunk": 16777216}']
    for damage in damages:
        record.write_bytes(damage)
        st = LoadStats()
        assert _same(cache.load(str(tmp_path / "m"), stats=st), ref)
        assert st.extra["cache"] == "miss"


def test_record_naming_a_file_outside_the_entry_is_not_trusted(tmp_path):
    ref = _model(tmp_path / "m")
    evil = {"l0.w": torch.zeros(64, 100), "l0.b": torch.zeros(7)}
    save_file(evil, str(tmp_path / "evil.safetensors"))
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    cache.fetch(str(tmp_path / "m"))
    record = cache.entries()[0].path / ".tierio-cache.json"
    doc = json.loads(record.read_text())
    outside = "../../../evil.safetensors"  # from cache/entries/<name>/ to tmp_path
    assert (record.parent / outside).resolve() == (tmp_path / "evil.safetensors").resolve()
    doc["kind"], doc["files_order"] = "file", [outside]
    doc["files"][outside] = {"size": (tmp_path / "evil.safetensors").stat().st_size, "mtime": 0.0}
    record.write_text(json.dumps(doc))
    st = LoadStats()
    assert _same(cache.load(str(tmp_path / "m"), stats=st), ref)  # never the outside file's tensors
    assert st.extra["cache"] == "miss"


class _HostileS3(http.server.BaseHTTPRequestHandler):
    """Answers ListObjectsV2, HEAD and ranged GET for a fixed set of objects, keys included that no
    real server stores (SeaweedFS refuses '..' in keys, so a hostile endpoint stands in for one)."""

    objects: ClassVar[dict[str, bytes]] = {}

    def log_message(self, *args) -> None:
        pass

    def _key(self) -> str:
        return unquote(urlsplit(self.path).path).split("/", 2)[2]

    def do_GET(self) -> None:
        u = urlsplit(self.path)
        if "list-type" in parse_qs(u.query):
            rows = "".join(
                f"<Contents><Key>{escape(k)}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                f"<ETag>\"e\"</ETag><Size>{len(v)}</Size><StorageClass>STANDARD</StorageClass></Contents>"
                for k, v in sorted(self.objects.items()))
            body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<Name>b</Name><Prefix></Prefix><KeyCount>{len(self.objects)}</KeyCount><MaxKeys>1000</MaxKeys>"
                    f"<IsTruncated>false</IsTruncated>{rows}</ListBucketResult>").encode()
            self._send(200, body, {"Content-Type": "application/xml"})
            return
        data = self.objects.get(self._key())
        if data is None:
            self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", {"Content-Type": "application/xml"})
            return
        lo, hi = 0, len(data) - 1
        if "Range" in self.headers:
            a, b = self.headers["Range"].split("=", 1)[1].split("-")
            lo, hi = int(a), min(int(b), len(data) - 1)
        self._send(206 if "Range" in self.headers else 200, data[lo : hi + 1],
                   {"Content-Range": f"bytes {lo}-{hi}/{len(data)}", "ETag": '"e"'})

    def do_HEAD(self) -> None:
        data = self.objects.get(self._key())
        if data is None:
            self._send(404, b"", {})
            return
        self._send(200, b"", {"Content-Length": str(len(data)), "ETag": '"e"',
                              "Last-Modified": formatdate(1_700_000_000, usegmt=True)}, length=False)

    def _send(self, code: int, body: bytes, headers: dict[str, str], length: bool = True) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def test_store_listing_with_dotdot_keys_makes_no_directory_outside_the_cache(tmp_path, monkeypatch):
    _model(tmp_path / "m")
    escape_dir = "escaped-by-listing"
    _HostileS3.objects = {
        "model/model.safetensors": (tmp_path / "m" / "model.safetensors").read_bytes(),
        f"model/a/../../../../../{escape_dir}/config.json": b"{}",
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "a" / "b" / "cache"
    try:
        url = f"s3://b/model?endpoint=http://127.0.0.1:{server.server_address[1]}"
        try:
            WeightCache(root, 1 << 30).fetch(url)
        except FormatError:
            pass  # the listing is refused; a store that drops such keys may let the fetch succeed
    finally:
        server.shutdown()
    made = [p for p in tmp_path.rglob(escape_dir)]
    assert made == []
