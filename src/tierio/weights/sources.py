"""What a weight source is: one .safetensors file, a Hugging Face model directory, a plain directory
of shards, or a tierio checkpoint; on a local path or behind a store URL (s3://...).

``resolve`` lists the shard files and reads every shard's header (strictly validated), so the
loaders know every tensor's file, byte range, dtype and shape before any data moves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.format.manifest import MAX_MANIFEST_BYTES
from tierio.format.safetensors import Header, TensorEntry, read_header_from
from tierio.io import engine
from tierio.errors import os_error
from tierio.io.paths import open_regular
from tierio.io.untrusted import Fields, check_str, loads, parser
from tierio.storage.base import check_key, where
from tierio.weights import checkpoint

INDEX_SUFFIX = ".safetensors.index.json"
PRESHARDED_INDEX = "tierio-tp.json"  # a directory cut per tensor-parallel rank (weights.presharded)
HEAD_PROBE = 1 << 20  # first GET of a remote shard: the header of nearly every real file fits
# the index of the largest models lists ~100k tensors in a few MB; a checkpoint manifest has its own limit
MAX_INDEX_BYTES = MAX_MANIFEST_BYTES
_PARALLEL = 8  # stats and header reads of a remote model's shards in flight at once


@dataclass(eq=False)  # identity semantics: shards are dict keys
class Shard:
    """One safetensors file of a model and its parsed header."""

    key: str  # name relative to the source root ("model-00001-of-00002.safetensors")
    size: int
    where: str  # path or URL, for messages
    mtime: float = 0.0
    path: Path | None = None  # set for local files
    store: Any = None  # set for remote files (a tierio Store)
    header: Header | None = None

    @property
    def data_offset(self) -> int:
        assert self.header is not None
        return self.header.data_offset


@dataclass
class ModelSource:
    url: str
    kind: str  # "file" | "hf" | "dir" | "tierio"
    shards: list[Shard]
    root: Path | None = None  # local directory holding the shards
    store: Any = None  # the store for remote sources
    keys: list[str] = field(default_factory=list)  # every file/key of the source (for caching)
    names: dict[str, str] | None = None  # stored name -> returned name (tierio checkpoints)

    @property
    def local(self) -> bool:
        return self.store is None

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def tensors(self) -> dict[str, tuple[Shard, TensorEntry]]:
        """Returned tensor name -> (shard, entry); duplicate names across shards are an error."""
        out: dict[str, tuple[Shard, TensorEntry]] = {}
        for s in self.shards:
            assert s.header is not None
            for stored, e in s.header.tensors.items():
                name = stored if self.names is None else self.names.get(stored)
                if name is None:
                    continue
                if name in out:
                    raise FormatError(
                        f"tensor {name!r} appears in both {out[name][0].where} and {s.where}; "
                        "a model's shards must hold disjoint tensors (resharded checkpoint slices are restored with tierio.ckpt)"
                    )
                out[name] = (s, e)
        return out


def _open(path: Path) -> int:
    """Open a local file of the model for reading (a FIFO or device is refused, not waited on)."""
    try:
        return open_regular(path)
    except OSError as exc:
        raise os_error(exc, path, "opening") from exc


def _read_small(path: Path, limit: int) -> bytes:
    """A small file of the model (an index, a manifest), refused above ``limit`` bytes."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FormatError(f"{path} is {size} bytes, above the {limit}-byte limit for it; it is corrupt or hostile")
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise os_error(exc, path, "reading") from exc
    finally:
        os.close(fd)


def _read_small_remote(store: Any, key: str, limit: int) -> bytes:
    from tierio.storage import read_bytes

    size = store.stat(key).size
    if size > limit:
        raise FormatError(f"{where(store, key)} is {size} bytes, above the {limit}-byte limit for it; it is corrupt or hostile")
    return read_bytes(store, key, 0, size)


@parser
def parse_hf_index(raw: bytes, where: str) -> list[str]:
    """The shard files named by a Hugging Face ``*.safetensors.index.json`` (sorted, distinct).

    Every file is checked as a relative key, so an index cannot name a file outside the model."""
    doc = Fields(loads(raw, where, limit=MAX_INDEX_BYTES), where)
    wm = doc.obj("weight_map", default=None)
    if wm is None or not wm.doc:
        raise FormatError(f"{where}: no 'weight_map' of tensor name -> file; the index is corrupt")
    return sorted({check_key(check_str(f, f"{where}: weight_map[{name!r}]"), where) for name, f in wm.doc.items()})


def is_remote(source: str | os.PathLike) -> bool:
    text = str(source)
    return "://" in text and not text.startswith("file://")


def _local_path(source: str | os.PathLike) -> Path:
    text = str(source)
    if text.startswith("file://"):
        text = urlsplit(text).path
    return Path(text).expanduser().absolute()


def _parent_url(url: str) -> tuple[str, str]:
    """('s3://b/models?endpoint=..', 'x.safetensors') for 's3://b/models/x.safetensors?endpoint=..'."""
    u = urlsplit(url)
    parent, _, name = u.path.rstrip("/").rpartition("/")
    return urlunsplit((u.scheme, u.netloc, parent, u.query, u.fragment)), name


def read_header_local(path: Path, where: str) -> Header:
    """The safetensors header of a local file (a FormatError names ``where`` when it is damaged)."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        return read_header_from(lambda off, n: os.pread(fd, n, off), size, where)
    except OSError as exc:
        raise os_error(exc, path, "reading the header of") from exc
    finally:
        os.close(fd)


def _read_header_remote(shard: Shard) -> Header:
    probe = bytearray(min(shard.size, HEAD_PROBE))
    if probe:
        shard.store.read_into(shard.key, 0, memoryview(probe))

    def read(off: int, n: int) -> bytes:
        if off + n <= len(probe):
            return bytes(probe[off : off + n])
        buf = bytearray(n)
        shard.store.read_into(shard.key, off, memoryview(buf))
        return bytes(buf)

    return read_header_from(read, shard.size, shard.where)


def _pick_kind(keys: list[str], read: Callable[[str], bytes], where: Callable[[str], str]) -> tuple[str, list[str], bool]:
    """(kind, shard keys, map names to the model subtree?) from a directory listing.

    ``read(key)`` returns a small file's bytes, ``where(key)`` names it in messages."""
    top = [k for k in keys if "/" not in k]
    if PRESHARDED_INDEX in top:
        raise ConfigError(f"{where(PRESHARDED_INDEX)}: the directory is pre-sharded for tensor parallelism: load one rank's "
                          "part with shard=TensorParallel(rank, size) (tierio weights load --tp N --rank R)")
    index = sorted(k for k in top if k.endswith(INDEX_SUFFIX))
    if index:
        files = parse_hf_index(read(index[0]), where(index[0]))
        present = set(keys)
        missing = [f for f in files if f not in present]
        if missing:
            raise NotFoundError(f"{index[0]} names shard(s) {missing[:3]} that are not in the model directory; the download is incomplete")
        return "hf", files, False
    if checkpoint.checkpoint_dir(keys) is not None:
        _, shards = checkpoint.checkpoint_shards(keys, read, where)
        return "tierio", shards, True
    shards = sorted(k for k in top if k.endswith(".safetensors"))
    if not shards:
        raise NotFoundError("no .safetensors files (and no model.safetensors.index.json or tierio manifest.json) found")
    return "dir", shards, False


def resolve(source: str | os.PathLike, *, read_headers: bool = True) -> ModelSource:
    """Find the shard files of ``source`` and read their headers."""
    text = str(source)
    if is_remote(text):
        return _resolve_remote(text, read_headers)
    path = _local_path(text)
    if path.is_file():
        st = path.stat()
        shard = Shard(path.name, st.st_size, str(path), st.st_mtime, path=path)
        src = ModelSource(str(path), "file", [shard], root=path.parent, keys=[path.name])
    elif path.is_dir():
        keys = sorted(
            str(p.relative_to(path)).replace(os.sep, "/") for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
        )

        try:
            kind, shard_keys, subtree = _pick_kind(keys, lambda key: _read_small(path / key, MAX_INDEX_BYTES), lambda key: str(path / key))
        except NotFoundError as exc:
            raise NotFoundError(f"{path}: {exc}") from None
        shards = []
        for k in shard_keys:
            p = path / k
            try:
                st = p.stat()
            except OSError as exc:
                raise os_error(exc, p, "reading") from exc
            shards.append(Shard(k, st.st_size, str(p), st.st_mtime, path=p))
        src = ModelSource(str(path), kind, shards, root=path, keys=keys)
        if subtree:
            src.names = {}  # filled once headers are read
    else:
        raise NotFoundError(f"{path} does not exist; give a .safetensors file, a model directory or an s3:// URL")
    if read_headers:
        for s in src.shards:
            s.header = read_header_local(s.path, s.where)
        _finish_names(src)
    return src


_stores: dict[str, Any] = {}
_stores_lock = threading.Lock()


def open_store(url: str) -> Any:
    """One store per URL per process: creating an S3 client costs more than a cache-hit load."""
    from tierio.storage import open_store as _open  # imported lazily (boto3 is slow to import)

    with _stores_lock:
        if url not in _stores:
            _stores[url] = _open(url)
        return _stores[url]


def _resolve_remote(url: str, read_headers: bool) -> ModelSource:
    u = urlsplit(url)
    if u.path.endswith(".safetensors"):
        parent, name = _parent_url(url)
        store = open_store(parent)
        info = store.stat(name)
        shards = [Shard(name, info.size, where(store, name), info.mtime, store=store)]
        src = ModelSource(url, "file", shards, store=store, keys=[name])
    else:
        store = open_store(url)
        keys = [k for k in store.list("") if not k.rsplit("/", 1)[-1].startswith(".")]
        if not keys:
            raise NotFoundError(f"{url} holds no objects; check the bucket and prefix")

        try:
            kind, shard_keys, subtree = _pick_kind(
                keys, lambda key: _read_small_remote(store, key, MAX_INDEX_BYTES), lambda key: where(store, key)
            )
        except NotFoundError as exc:
            raise NotFoundError(f"{url}: {exc}") from None
        infos = engine.run_windows(shard_keys, store.stat, depth=_PARALLEL)
        shards = [Shard(k, i.size, where(store, k), i.mtime, store=store) for k, i in zip(shard_keys, infos)]
        src = ModelSource(url, kind, shards, store=store, keys=keys, names={} if subtree else None)
    if read_headers:
        for s, h in zip(src.shards, engine.run_windows(src.shards, _read_header_remote, depth=_PARALLEL)):
            s.header = h
        _finish_names(src)
    return src


def read_small_file(src: ModelSource, key: str, limit: int = MAX_INDEX_BYTES) -> bytes | None:
    """A small file beside the shards (``config.json``), refused above ``limit``; None when absent."""
    if src.store is not None:
        return _read_small_remote(src.store, key, limit) if key in src.keys else None
    if src.root is None or not (src.root / key).is_file():
        return None
    return _read_small(src.root / key, limit)


def _finish_names(src: ModelSource) -> None:
    if src.names is not None:
        stored = [n for s in src.shards for n in s.header.tensors]  # type: ignore[union-attr]
        src.names = checkpoint.model_names(stored)



__all__ = ["ModelSource", "Shard", "is_remote", "parse_hf_index", "read_small_file", "resolve"]
