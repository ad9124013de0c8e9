"""The shared checks for untrusted bytes (io.untrusted) and names from data (io.paths)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.io.paths import key_parts, open_beneath, open_regular
from tierio.io.untrusted import Fields, loads, parser, read_json_file
from tierio.storage import LocalStore


@pytest.mark.parametrize("raw", [
    b"[" * 5000 + b"]" * 5000,  # RecursionError inside json
    b'{"a":' + b"[" * 100 + b"]" * 100 + b"}",  # deeper than MAX_DEPTH, shallow for json
    b'{"size": NaN}', b'{"size": Infinity}', b"1e400",  # non-finite numbers
    b"9" * 5000,  # ValueError: int over 4300 digits
    b"\xff\xfe{}",  # not UTF-8
    b'{"a": 1',  # truncated
])
def test_loads_only_raises_format_error(raw: bytes) -> None:
    with pytest.raises(FormatError, match="doc.json"):
        loads(raw, "doc.json", limit=1 << 20)


def test_loads_refuses_oversized_before_parsing() -> None:
    with pytest.raises(FormatError, match="above the 10-byte limit"):
        loads(b'{"a": 123456789}', "doc.json", limit=10)


def test_fields_check_type_and_range() -> None:
    f = Fields({"samples": 1e10, "xxh3": "../../victim", "flag": True, "n": 3, "name": "../x"}, "index.json")
    assert f.int("n", 0, 10) == 3
    assert f.int("absent", default=7) == 7
    for call in (lambda: f.int("samples"), lambda: f.hex("xxh3", 16), lambda: f.int("flag"),
                 lambda: f.int("n", 4, 10), lambda: f.name("name"), lambda: f.int("absent")):
        with pytest.raises(FormatError, match="index.json"):
            call()


def test_parser_net_names_the_file() -> None:
    @parser
    def parse(doc: dict, where: str) -> int:
        return doc["missing"] + 1

    with pytest.raises(FormatError, match="shard.idx"):
        parse({}, where="shard.idx")
    with pytest.raises(FormatError, match="other.idx"):
        parse({}, "other.idx")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b", "a\x00b"])
def test_key_parts_refuses_escapes(key: str) -> None:
    with pytest.raises(ConfigError):
        key_parts(key)
    with pytest.raises(FormatError, match="manifest.json"):
        key_parts(key, where="manifest.json")


def test_open_beneath_follows_no_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "step").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"outside")
    (root / "step" / "ok").write_bytes(b"inside")
    os.symlink(outside / "secret", root / "step" / "file-link")
    os.symlink(outside, root / "dir-link")
    fd = open_beneath(root, "step/ok")
    assert os.read(fd, 10) == b"inside"
    os.close(fd)
    for key in ("step/file-link", "dir-link/secret"):
        with pytest.raises(FormatError, match="symbolic link"):
            open_beneath(root, key)
    with pytest.raises(NotFoundError):
        open_beneath(root, "step/absent")


@pytest.mark.timeout(30)
def test_fifo_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "data.idx"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="not a regular file"):
        open_regular(fifo)
    with pytest.raises(FormatError, match="not a regular file"):
        open_beneath(tmp_path, "data.idx")
    with pytest.raises(FormatError, match="not a regular file"):
        read_json_file(fifo, missing="write it")


def test_read_json_file_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="run the probe"):
        read_json_file(tmp_path / "absent.json", missing="run the probe")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": [' * 200)
    with pytest.raises(FormatError, match="bad.json"):
        read_json_file(bad, missing="x", what="give a probe file")


def test_local_store_does_not_follow_planted_links(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "tier")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    store.put_buffers("step_000000001/rank_00000.safetensors", [b"shard"])
    os.symlink(outside / "victim", store.root / "step_000000001" / "manifest.json")
    os.symlink(outside, store.root / "step_000000002")
    assert store.list() == ["step_000000001/rank_00000.safetensors"]
    assert not store.exists("step_000000001/manifest.json")
    with pytest.raises(FormatError):
        store.stat("step_000000002/victim")
    with pytest.raises(FormatError):
        store.put_buffers("step_000000002/victim", [b"overwritten"])
    store.delete("step_000000002/victim")  # not ours: left alone
    store.delete_prefix("step_000000002/")
    assert (outside / "victim").read_bytes() == b"precious"


def test_local_store_cleanup_spares_live_writers(tmp_path: Path) -> None:
    from tierio.io.files import FileWriter

    store = LocalStore(tmp_path / "tier")
    d = store.root / "step_000000001"
    d.mkdir()
    (d / ".rank_00000.safetensors.tmp-dead").write_bytes(b"left by a killed writer")
    live = FileWriter(d / ".rank_00001.safetensors.tmp-live")
    live.write(b"x" * 4096)
    try:
        assert store.cleanup() == 1
        assert sorted(p.name for p in d.iterdir()) == [".rank_00001.safetensors.tmp-live"]
    finally:
        live.close()
    assert store.cleanup() == 1  # the writer is done with it (it would have renamed it)
    assert store.create_exclusive("lease", b"me")
    assert not store.create_exclusive("lease", b"you")
    assert store.capacity() is not None
