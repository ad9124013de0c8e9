"""A token dataset built in parts: Megatron ``.bin``/``.idx`` pairs plus one manifest naming them.

A distributed build (``tierio.data.raybuild``) writes one part per input file, in any order, on
any worker, into a local directory or a store (``s3://...``). Each part is published on its own:
``part-NNNNNN.bin`` and ``.idx`` first, then ``part-NNNNNN.json``, its record (counts, sizes,
xxh3 of both files, and the fingerprint of the input and settings it was built from). The record
is the part's commit: a part without one is not there, and a rerun skips a part whose record
matches its input. ``parts.json``, written last from the records alone, names the parts in input
order: that order comes from the inputs, never from which task finished first.

The part index ``i`` is the ``i``-th input; Megatron takes the parts as one dataset through its
``data_path`` (one prefix each), and ``tierio data merge`` joins them into one ``.bin``/``.idx``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.errors import FormatError, NotFoundError
from tierio.io.checksum import StreamingChecksum, xxh3
from tierio.io.untrusted import Fields, loads, parser
from tierio.stats import Stats
from tierio.storage.base import Store, read_small, where

PARTS_FORMAT = "tierio-token-parts"
PARTS_VERSION = 1
MANIFEST_KEY = "parts.json"
RECORD_LIMIT = 1 << 16
MANIFEST_LIMIT = 1 << 30
MAX_PARTS = 1 << 22
IDX_HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16")
_NAME = re.compile(r"part-\d{6,9}")


def part_name(index: int) -> str:
    return f"part-{index:06d}"


@dataclass(frozen=True)
class PartSettings:
    """How every part is built (the same for all): what `tierio data build` takes, per input."""

    key: str = "tokens"
    tokenizer: str | None = None
    text_key: str = "text"
    column: str | None = None
    text_column: str | None = None
    vocab_size: int | None = None
    append_eos: int | None = None

    def fingerprint(self) -> dict[str, Any]:
        """The settings as they decide the bytes: the tokenizer by its content, not its path."""
        doc = asdict(self)
        if self.tokenizer is not None:
            doc["tokenizer"] = xxh3(Path(self.tokenizer).read_bytes())
        return doc


@dataclass(frozen=True)
class PartSpec:
    """What one part is built from: the ``index``-th input and the fingerprint of input and settings."""

    index: int
    input: str
    fingerprint: str

    @property
    def name(self) -> str:
        return part_name(self.index)


def plan_parts(inputs: Sequence[str | Path], settings: PartSettings) -> list[PartSpec]:
    """One part per input file (directories: their files, sorted by path), fingerprinted by path,
    size, modification time and the settings: a rerun rebuilds a part only when one changed."""
    files: list[Path] = []
    for p in map(Path, inputs):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise NotFoundError(f"input {p} does not exist (or is not a file or directory)")
    if not files:
        raise NotFoundError(f"no input files in {', '.join(map(str, inputs))}")
    common = settings.fingerprint()
    specs = []
    for i, f in enumerate(files):
        st = f.stat()
        doc = {"input": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "settings": common}
        specs.append(PartSpec(i, str(f), xxh3(json.dumps(doc, sort_keys=True).encode())))
    return specs


@dataclass
class PartRecord(Stats):
    """One published part: its counts, its files' sizes and xxh3, and what it was built from."""

    name: str
    input: str
    fingerprint: str
    dtype: str
    documents: int
    sequences: int
    tokens: int
    bin_bytes: int
    idx_bytes: int
    bin_xxh3: str
    idx_xxh3: str

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    def check_sizes(self, where: str) -> None:
        """The counts agree with each other and with the files' sizes (a Megatron index's layout)."""
        itemsize = np.dtype(self.dtype).itemsize
        if self.bin_bytes != self.tokens * itemsize:
            raise FormatError(f"{where}: {self.tokens} {self.dtype} tokens take {self.tokens * itemsize} bytes, "
                              f"but the record says the .bin has {self.bin_bytes}")
        idx = IDX_HEADER_BYTES + 12 * self.sequences + 8 * (self.documents + 1)
        if self.idx_bytes != idx or self.documents > self.sequences:
            raise FormatError(f"{where}: {self.sequences} sequences in {self.documents} documents make a {idx}-byte "
                              f".idx, but the record says {self.idx_bytes}")


@parser
def parse_record(doc: Any, where: str) -> PartRecord:
    f = Fields(doc, where)
    name = f.name("name")
    if not _NAME.fullmatch(name):
        raise FormatError(f"{where}: part name {name!r} is not part-NNNNNN")
    rec = PartRecord(name, f.str("input"), f.hex("fingerprint", 16), f.const("dtype", *DTYPES), f.int("documents"),
                     f.int("sequences"), f.int("tokens"), f.int("bin_bytes"), f.int("idx_bytes"),
                     f.hex("bin_xxh3", 16), f.hex("idx_xxh3", 16))
    rec.check_sizes(where)
    return rec


def file_xxh3(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    h = StreamingChecksum()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def publish_part(store: Store, spec: PartSpec, prefix: Path, dtype: str, counts: tuple[int, int, int]) -> PartRecord:
    """Put a part built at local ``prefix`` (.bin, .idx) into ``store``, its record last (the commit)."""
    documents, sequences, tokens = counts
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    rec = PartRecord(spec.name, spec.input, spec.fingerprint, dtype, documents, sequences, tokens,
                     bin_file.stat().st_size, idx_file.stat().st_size, file_xxh3(bin_file), file_xxh3(idx_file))
    rec.check_sizes(f"part {spec.name} of {spec.input}")
    store.put_file(f"{spec.name}.bin", bin_file)
    store.put_file(f"{spec.name}.idx", idx_file)
    store.put_buffers(f"{spec.name}.json", [rec.to_bytes()])
    return rec


def read_record(store: Store, name: str) -> PartRecord | None:
    """The record of part ``name``, or None when the part is not published."""
    key = f"{name}.json"
    try:
        raw = read_small(store, key, RECORD_LIMIT)
    except NotFoundError:
        return None
    w = where(store, key)
    return parse_record(loads(raw, w, limit=RECORD_LIMIT), w)


@dataclass
class PartsManifest(Stats):
    """``parts.json``: the parts of a dataset in input order, with the totals."""

    dtype: str
    parts: list[PartRecord]
    documents: int
    tokens: int

    def to_bytes(self) -> bytes:
        doc = {"format": PARTS_FORMAT, "version": PARTS_VERSION, **self.to_dict()}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    def prefixes(self, root: str | os.PathLike[str]) -> list[str]:
        """The parts as dataset prefixes under a local ``root`` (what Megatron's ``data_path`` takes)."""
        return [str(Path(root) / p.name) for p in self.parts]


def manifest_of(records: Sequence[PartRecord]) -> PartsManifest:
    """The manifest of ``records`` (any order in; input order out). Parts must share one dtype."""
    parts = sorted(records, key=lambda r: int(r.name.split("-")[1]))
    dtypes = {r.dtype for r in parts}
    if len(dtypes) > 1:
        raise FormatError(f"parts have different token dtypes {sorted(dtypes)}; build them with one --vocab-size")
    return PartsManifest(dtypes.pop() if dtypes else "int32", parts, sum(r.documents for r in parts),
                         sum(r.tokens for r in parts))


@parser
def parse_manifest(doc: Any, where: str) -> PartsManifest:
    f = Fields(doc, where)
    f.const("format", PARTS_FORMAT)
    f.const("version", PARTS_VERSION)
    parts = [parse_record(p, f"{where}: part {i}") for i, p in enumerate(f.list("parts", MAX_PARTS))]
    if len({p.name for p in parts}) != len(parts):
        raise FormatError(f"{where}: a part is named twice")
    man = manifest_of(parts)
    if (f.const("dtype", *DTYPES), f.int("documents"), f.int("tokens")) != (man.dtype, man.documents, man.tokens):
        raise FormatError(f"{where}: the totals do not agree with the parts ({man.documents} documents, "
                          f"{man.tokens} tokens, {man.dtype})")
    return man


def load_parts(store: Store, check_files: bool = True) -> PartsManifest:
    """The manifest of a parts dataset; with ``check_files`` every part's files exist with their sizes."""
    w = where(store, MANIFEST_KEY)
    man = parse_manifest(loads(read_small(store, MANIFEST_KEY, MANIFEST_LIMIT), w, limit=MANIFEST_LIMIT), w)
    for rec in man.parts if check_files else ():
        for ext, size in (("bin", rec.bin_bytes), ("idx", rec.idx_bytes)):
            real = store.stat(f"{rec.name}.{ext}").size
            if real != size:
                raise FormatError(f"{where(store, rec.name + '.' + ext)} has {real} bytes; {w} says {size}")
    return man


__all__ = [
    "MANIFEST_KEY", "PartRecord", "PartSettings", "PartSpec", "PartsManifest", "file_xxh3", "load_parts",
    "manifest_of", "parse_manifest", "parse_record", "part_name", "plan_parts", "publish_part", "read_record",
]
