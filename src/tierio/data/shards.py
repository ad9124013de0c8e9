"""Sample shards in any store: a manifest, written last, and shards in one of two containers.

A dataset is a key prefix in any Store holding

    shard-000000.cols      (default) the compact container: each field's samples stored
    shard-000001.cols      contiguously, see tierio.data.columns
    ...
    index.json             the manifest, written last (the commit): fields and their types,
                           sample counts, each shard's size, xxh3-64, column layout and the
                           xxh3 of each window of it

or, with ``format="tar"``, the WebDataset layout (``shard-000000.tar`` + ``shard-000000.idx.npy``,
see tierio.data.tar) that any tar tool and the ``webdataset`` library read as they are.

Shards are cut at ``shard_bytes`` (default 64 MiB): large sequential objects keep object stores
and parallel filesystems at full speed and keep metadata operations per byte low. A writer fills
one shard in memory while the shards before it are stored in the background (``in_flight`` at a
time, each an S3 multipart upload with its parts in parallel), so writing to S3 costs what the
upload costs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierio.data.columns import (
    MAX_WINDOW,
    MIN_WINDOW,
    ColumnLayout,
    FieldType,
    ShardBuilder,
    check_windows,
    dataset_types,
    parse_column,
    parse_field_type,
    window_digests,
)
from tierio.data.tar import (
    NPY_HEADER_MAX,
    TAR_HEADER,
    ShardFile,
    TarShardBuilder,
    decode_npy,
    encode_npy,
    index_row_bytes,
    iter_tar_samples,
    parse_index,
)
from tierio.data.options import DEFAULT_SHARD_SIZE, ShardOptions
from tierio.data.shardinfo import Container, ShardInfo
from tierio.data.uploads import BackgroundPuts
from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.io.checksum import StreamingChecksum, xxh3
from tierio.io.files import os_error
from tierio.io.untrusted import Fields, check_hex, loads, parser
from tierio.stats import Stats
from tierio.storage.base import Store, check_key, read_bytes
from tierio.storage.url import as_store

MANIFEST = "index.json"
FORMAT = "tierio-shards"
VERSION = 1  # the tar layout (unchanged since the first release, so older readers still read it)
COLUMNS_VERSION = 2  # the compact container
MAX_MANIFEST_BYTES = 64 << 20  # a million shards fit
MAX_SHARDS = 1 << 22
MAX_FIELDS = 1 << 10
_FIELD = re.compile(r"[^./\x00]{1,255}")  # a field name is part of a tar member's name


@dataclass
class ShardManifest(Stats):
    """A shard dataset's manifest (``index.json``): its fields, shards and sample count."""

    fields: list[str]
    shards: list[ShardInfo]
    num_samples: int
    meta: dict[str, Any]
    fingerprint: str = ""  # xxh3 of the manifest bytes
    container: Container = "tar"
    types: list[FieldType] = field(default_factory=list)  # columns datasets: one per field

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def max_shard_size(self) -> int:
        return max((s.size for s in self.shards), default=0)

    def layout(self, shard: int) -> ColumnLayout:
        """Where the columns of a columns shard lie (checked when the manifest was parsed)."""
        info = self.shards[shard]
        return ColumnLayout(tuple(self.types), info.columns, info.samples, info.size)


def load_manifest(store_or_url: Store | str | Path, where: str | None = None) -> ShardManifest:
    """Read and strictly parse a dataset's ``index.json`` (only TierioErrors come out)."""
    store = as_store(store_or_url)
    where = where or store.url
    try:
        size = store.stat(MANIFEST).size
    except NotFoundError:
        raise NotFoundError(f"no {MANIFEST} under {where}: not a shard dataset, or it was never completed (the manifest is written last)") from None
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where}/{MANIFEST} is {size} bytes, above the {MAX_MANIFEST_BYTES}-byte limit; it is corrupt or hostile")
    return parse_manifest(read_bytes(store, MANIFEST, 0, size), f"{where}/{MANIFEST}")


def check_field(name: Any, where: str) -> str:
    """A field name: part of tar member names ``<key>.<field>.npy``, so no '.', '/' or NUL."""
    if not isinstance(name, str) or not _FIELD.fullmatch(name):
        raise FormatError(f"{where}: field name {name!r:.80} must be 1-255 characters without '.', '/' or NUL")
    return name


def _head(f: Fields, manifest: str) -> dict[str, Any]:
    """The fields every shard entry has, typed."""
    return {"key": check_key(f.str("key", 1024), manifest), "size": f.int("size"), "xxh3": f.hex("xxh3", 16),
            "samples": f.int("samples"), "first_sample": f.int("first_sample")}


def _tar_shard(doc: Any, where: str, manifest: str, nfields: int) -> ShardInfo:
    f = Fields(doc, where)
    info = ShardInfo(**_head(f, manifest), index_key=check_key(f.str("index_key", 1024), manifest),
                     index_size=f.int("index_size"), index_xxh3=f.hex("index_xxh3", 16))
    # Declared counts are checked against declared sizes before anything is allocated from them:
    # every sample holds `nfields` tar members, and its index row is (2 * nfields + 1) int64s.
    if info.samples * nfields * TAR_HEADER > info.size:
        raise FormatError(f"{where}: {info.samples} samples of {nfields} fields cannot fit in {info.size} bytes of tar")
    header = info.index_size - info.samples * index_row_bytes(nfields)
    if not 0 < header <= NPY_HEADER_MAX + 12:
        raise FormatError(f"{where}: an index of {info.samples} samples cannot be {info.index_size} bytes")
    return info


def _columns_shard(doc: Any, where: str, manifest: str, types: list[FieldType]) -> ShardInfo:
    f = Fields(doc, where)
    head = _head(f, manifest)
    window = f.int("window", MIN_WINDOW, MAX_WINDOW)
    windows = f.list("windows", -(-head["size"] // window) if head["size"] else 0)
    check_windows(head["size"], window, windows, where)
    digests = tuple(check_hex(w, f"{where}: window {i}", 16) for i, w in enumerate(windows))
    columns = tuple(parse_column(c, f"{where} column {j}") for j, c in enumerate(f.list("columns", len(types))))
    info = ShardInfo(**head, columns=columns, window=window, windows=digests)
    ColumnLayout(tuple(types), columns, info.samples, info.size).check(where)  # every byte range, before any view
    return info


@parser
def parse_manifest(raw: bytes, where: str) -> ShardManifest:
    """Strictly parse the bytes of a dataset manifest: typed fields, keys that stay inside the
    dataset, hex digests, and counts consistent with each other and with the declared sizes."""
    doc = Fields(loads(raw, where, limit=MAX_MANIFEST_BYTES), where)
    version = doc.doc.get("version")
    if doc.doc.get("format") != FORMAT or type(version) is not int or version not in (VERSION, COLUMNS_VERSION):
        raise FormatError(f"{where} is not a {FORMAT} v{VERSION} or v{COLUMNS_VERSION} manifest")
    fields = [check_field(x, where) for x in doc.list("fields", MAX_FIELDS)]
    if not fields or len(set(fields)) != len(fields):
        raise FormatError(f"{where}: fields {fields!r:.200} must be distinct and at least one")
    num_samples = doc.int("num_samples")
    meta = doc.obj("meta", default=None)
    entries = doc.list("shards", MAX_SHARDS)
    types: list[FieldType] = []
    if version == VERSION:
        shards = [_tar_shard(x, f"{where} shard {i}", where, len(fields)) for i, x in enumerate(entries)]
    else:
        doc.const("container", "columns")
        declared = doc.list("types", len(fields))
        if len(declared) != len(fields) and (entries or declared):
            raise FormatError(f"{where}: {len(declared)} field types for {len(fields)} fields")
        types = [parse_field_type(t, f"{where} type {j}", fields[j]) for j, t in enumerate(declared)]
        shards = [_columns_shard(x, f"{where} shard {i}", where, types) for i, x in enumerate(entries)]
    _check_shard_list(shards, num_samples, where)
    return ShardManifest(fields, shards, num_samples, {} if meta is None else meta.doc, xxh3(raw),
                    "tar" if version == VERSION else "columns", types)


def _check_shard_list(shards: list[ShardInfo], num_samples: int, where: str) -> None:
    total = 0
    keys: set[str] = {MANIFEST}
    for s in shards:
        if s.first_sample != total:
            raise FormatError(f"{where}: sample counts of {s.key} are inconsistent; the manifest is corrupt")
        total += s.samples
        names = (s.key, s.index_key) if s.index_key else (s.key,)
        if any(n in keys for n in names) or s.key == s.index_key:
            raise FormatError(f"{where}: {s.key} or {s.index_key} is named twice; the manifest is corrupt")
        keys.update(names)
    if total != num_samples:
        raise FormatError(f"{where}: shards hold {total} samples, manifest says {num_samples}")


# -- writing ------------------------------------------------------------------------------------
class ShardWriter:
    """Write samples (dicts of field -> array) into shards of at least ``shard_bytes`` bytes.

    ``options`` (a ShardOptions, keyword overrides on top): ``format`` "columns" (default, the
    compact container) or "tar" (the WebDataset layout); ``window_bytes`` per checksum window of a
    columns shard. Each finished shard is stored under ``store`` in the background while the next
    fills, at most ``in_flight`` at a time; ``close()`` waits for them and writes the manifest last.
    Use as a context manager: on error no manifest is written, so readers never see a
    half-written dataset.
    """

    def __init__(self, store: Store | str | Path, fields: Iterable[str], *, meta: dict[str, Any] | None = None,
                 options: ShardOptions | None = None, **overrides: Any) -> None:
        opts = ShardOptions.resolve(options, overrides)
        self.options = opts
        self.store = as_store(store)
        self.fields = list(fields)
        if not self.fields or len(set(self.fields)) != len(self.fields) or not all(
            isinstance(f, str) and _FIELD.fullmatch(f) for f in self.fields
        ):
            raise ConfigError(f"field names must be distinct, 1-255 characters, with no '.', '/' or NUL: {self.fields}")
        self.shard_size = int(opts.shard_bytes)
        if self.shard_size < 1:
            raise ConfigError("shard_bytes must be positive")
        format, window = opts.format, opts.window_bytes
        if format not in ("columns", "tar"):
            raise ConfigError(f"format must be 'columns' or 'tar', got {format!r}")
        try:
            check_windows(0, window, [], "window")  # type: ignore[arg-type]
        except FormatError:
            raise ConfigError(f"window must be a power of two from {MIN_WINDOW} to {MAX_WINDOW} bytes, got {window!r}") from None
        self.format: Container = format
        self.window = window
        self.meta = dict(meta or {})
        self.shards: list[ShardInfo] = []
        self.num_samples = 0
        self._builder: ShardBuilder | TarShardBuilder = (
            ShardBuilder(self.fields, self.shard_size) if format == "columns" else TarShardBuilder(self.fields, self.shard_size))
        self._shapes: list[tuple[tuple[int, ...] | None, ...]] = []  # per columns shard: each field's one shape
        self._puts = BackgroundPuts(self.store, opts.in_flight)
        self.manifest: ShardManifest | None = None

    def write(self, sample: dict[str, Any]) -> None:
        if self.manifest is not None:
            raise ConfigError(f"the dataset at {self.store.url} is closed; start a new ShardWriter to add samples")
        full = self._builder.add(sample, self.num_samples)
        self.num_samples += 1
        if full:
            self._flush()

    def write_all(self, samples: Iterable[dict[str, Any]]) -> None:
        for s in samples:
            self.write(s)

    def _flush(self) -> None:
        n = self._builder.samples
        if not n:
            return
        first = self.num_samples - n
        number = len(self.shards)
        if isinstance(self._builder, ShardBuilder):
            built = self._builder.build()
            whole, windows = window_digests(built.pieces, self.window)
            key = f"shard-{number:06d}.cols"
            self._puts.put(key, built.pieces)
            self._shapes.append(built.shapes)
            self.shards.append(ShardInfo(key, built.size, whole, n, first, columns=built.columns, window=self.window,
                                         windows=tuple(windows)))
        else:
            data, index = self._builder.build()
            key, ikey = f"shard-{number:06d}.tar", f"shard-{number:06d}.idx.npy"
            self._puts.put(key, [data])
            self._puts.put(ikey, [index])
            self.shards.append(ShardInfo(key, len(data), xxh3(data), n, first, ikey, len(index), xxh3(index)))

    def close(self) -> ShardManifest:
        if self.manifest is not None:
            return self.manifest
        self._flush()
        self._puts.wait()  # every shard is stored before the manifest names it
        doc: dict[str, Any] = {"format": FORMAT, "version": VERSION if self.format == "tar" else COLUMNS_VERSION}
        types: list[FieldType] = []
        if self.format == "columns":
            rows = self._builder.rows if isinstance(self._builder, ShardBuilder) else {}
            types = dataset_types(rows, self._shapes, self.fields) if self.shards else []
            doc.update({"container": "columns", "types": [t.to_json() for t in types]})
        doc.update({"fields": self.fields, "num_samples": self.num_samples, "meta": self.meta,
                    "shards": [s.to_dict() for s in self.shards]})
        try:
            raw = json.dumps(doc, indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"dataset meta must be plain JSON without NaN or infinity: {exc}") from None
        self.store.put_buffers(MANIFEST, [raw])
        self.manifest = ShardManifest(self.fields, self.shards, self.num_samples, self.meta, xxh3(raw), self.format, types)
        return self.manifest

    def abort(self) -> None:
        """Stop: shards not yet stored are dropped, and no manifest is written."""
        self._puts.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_packed_shards(packed, store: Store | str | Path, *, options: ShardOptions | None = None,
                        **overrides: Any) -> ShardManifest:
    """Write every pack of a PackedDataset as a sample {tokens, seqlens} (tokens in the corpus dtype);
    ``options``/``overrides`` are the ShardWriter's (``shard_bytes``, ``format``)."""
    meta = {"kind": "packed", "seq_len": packed.plan.seq_len, "algorithm": packed.plan.algorithm, "source": packed.plan.source}
    with ShardWriter(store, ["tokens", "seqlens"], meta=meta, options=ShardOptions.resolve(options, overrides)) as w:
        for i in range(len(packed)):
            tokens, lens = packed.pack_tokens(i)
            w.write({"tokens": tokens, "seqlens": lens})
    return w.manifest  # type: ignore[return-value]


def verify_file(path: str | Path, expected: str, size: int, where: str) -> None:
    """Stream a local file through xxh3 and compare (IntegrityError naming ``where``)."""
    p = Path(path)
    h = StreamingChecksum()
    n = 0
    try:
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            mv = memoryview(buf)
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                h.update(mv[:got])
                n += got
    except OSError as exc:
        raise os_error(exc, p, "verifying") from exc
    if n != size:
        raise IntegrityError(f"{where}: {n} bytes, manifest says {size}; the copy is truncated or wrong")
    got_hex = h.hexdigest()
    if got_hex != expected:
        raise IntegrityError(f"{where}: checksum mismatch (expected xxh3 {expected}, got {got_hex}); this copy is corrupt")


__all__ = [
    "COLUMNS_VERSION", "DEFAULT_SHARD_SIZE", "FORMAT", "MANIFEST", "VERSION", "ShardFile", "ShardInfo", "ShardManifest",
    "ShardOptions", "ShardWriter", "check_field", "decode_npy", "encode_npy", "index_row_bytes", "iter_tar_samples", "load_manifest",
    "parse_index", "parse_manifest", "verify_file", "write_packed_shards",
]


def __getattr__(name: str) -> Any:
    if name == "Manifest":  # renamed: format/ has the checkpoint manifest under that name
        import warnings

        warnings.warn("tierio.data.shards.Manifest is deprecated, use ShardManifest", DeprecationWarning, stacklevel=2)
        return ShardManifest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
