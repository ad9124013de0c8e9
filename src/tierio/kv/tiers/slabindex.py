"""The on-disk facts of an NVMe KV tier: its header and its slot index.

``kvtier.json`` (the header) says how the slab files are cut: block and slot size, slots per slab,
slab count, and the layout for people reading it. ``index.bin`` holds one 64-byte record per slot:

    magic "TKVR" | state u32 | key 16 B | parent key 16 B | xxh3-64 of the block u64 | seq u64 | xxh3-64 of the 56 bytes before

A record is the commit of its slot: the block's bytes are written first and the record after, and
a slot about to be overwritten has its record zeroed first, so after a crash a slot is either
committed (record valid) or free. Both files are untrusted when read back (a crash, a flipped bit,
a hostile hand): the header goes through bounded JSON and typed fields, every record is checked
(magic, state, its own checksum, the slot lying inside its slab file's real size, no key twice),
and whatever fails is discarded and counted, never served. The block bytes themselves are checked
against the record's xxh3 on every read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from tierio.errors import FormatError
from tierio.io.buffers import ALIGN, align_up
from tierio.io.checksum import xxh3_int
from tierio.io.untrusted import Fields, loads, parsing

FORMAT = "tierio-kv-slab"
VERSION = 1
HEADER_NAME = "kvtier.json"
INDEX_NAME = "index.bin"
LOCK_NAME = ".lock"
HEADER_LIMIT = 64 << 10

MAGIC = b"TKVR"
USED = 1
_BODY = struct.Struct("<4sI16s16sQQ")
RECORD_BYTES = 64
FREE_RECORD = bytes(RECORD_BYTES)

MAX_SLOTS = 1 << 24          # 16 M slots: a 1 GiB index; 10 TB of 1 MiB blocks fits
MAX_SLOT_BYTES = 1 << 34     # 16 GiB: no block of any model comes near
MAX_SLABS = 1 << 16


def slab_name(i: int) -> str:
    return f"slab-{i:05d}.kv"


@dataclass(frozen=True)
class Geometry:
    """How the slab files are cut: ``slabs`` files of ``slots_per_slab`` slots of ``slot_bytes``."""

    block_bytes: int
    slot_bytes: int
    slots_per_slab: int
    slabs: int

    @property
    def nslots(self) -> int:
        return self.slots_per_slab * self.slabs

    @property
    def slab_bytes(self) -> int:
        return self.slots_per_slab * self.slot_bytes

    def locate(self, slot: int) -> tuple[int, int]:
        """(slab number, byte offset in that slab) of ``slot``."""
        return slot // self.slots_per_slab, (slot % self.slots_per_slab) * self.slot_bytes

    @classmethod
    def for_budget(cls, block_bytes: int, budget: int, slab_bytes: int) -> Geometry:
        slot = align_up(block_bytes, ALIGN)
        per = max(1, min(slab_bytes, budget) // slot)
        return cls(block_bytes, slot, per, budget // (per * slot))

    def header(self, layout: dict) -> dict:
        return {"format": FORMAT, "version": VERSION, "block_bytes": self.block_bytes, "slot_bytes": self.slot_bytes,
                "slots_per_slab": self.slots_per_slab, "slabs": self.slabs, "layout": layout}


@dataclass(frozen=True)
class Header:
    geometry: Geometry
    layout: dict


def parse_header(raw: bytes, where: str) -> Header:
    """The header of a tier, every field typed and bounded; FormatError naming ``where`` otherwise."""
    with parsing(where):
        f = Fields(loads(raw, where, limit=HEADER_LIMIT), where)
        f.const("format", FORMAT)
        f.int("version", VERSION, VERSION)
        block = f.int("block_bytes", 1, MAX_SLOT_BYTES)
        slot = f.int("slot_bytes", ALIGN, MAX_SLOT_BYTES)
        if slot != align_up(block, ALIGN):
            raise FormatError(f"{where}: slot_bytes {slot} is not block_bytes {block} rounded up to {ALIGN}")
        per = f.int("slots_per_slab", 1, MAX_SLOTS)
        slabs = f.int("slabs", 0, MAX_SLABS)
        if per * slabs > MAX_SLOTS:
            raise FormatError(f"{where}: {slabs} slabs of {per} slots is more than {MAX_SLOTS} slots")
        layout = f.obj("layout", default=None)
        return Header(Geometry(block, slot, per, slabs), layout.doc if layout is not None else {})


@dataclass(frozen=True)
class SlotRecord:
    """The commit of one slot: which block it holds, its parent, its checksum, when it was written."""

    slot: int
    key: bytes
    parent: bytes
    checksum: int
    seq: int

    def pack(self) -> bytes:
        body = _BODY.pack(MAGIC, USED, self.key, self.parent, self.checksum, self.seq)
        return body + struct.pack("<Q", xxh3_int(body))


@dataclass
class IndexScan:
    """Records that passed every check (by slot), and how many non-empty records did not."""

    records: list[SlotRecord] = field(default_factory=list)
    discarded: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def discard(self, why: str) -> None:
        self.discarded += 1
        self.reasons[why] = self.reasons.get(why, 0) + 1


def _record(raw: bytes, slot: int) -> SlotRecord | str:
    """One record, or why it is not one."""
    body, (total,) = raw[:56], struct.unpack_from("<Q", raw, 56)
    if xxh3_int(body) != total:
        return "torn or damaged record"
    magic, state, key, parent, checksum, seq = _BODY.unpack(body)
    if magic != MAGIC or state != USED:
        return "unknown record type"
    return SlotRecord(slot, key, parent, checksum, seq)


def parse_index(raw: bytes, where: str, nslots: int, usable: Callable[[int], bool]) -> IndexScan:
    """Every committed record among the first ``nslots`` of ``raw``. ``usable(slot)`` says whether
    the slot lies inside its slab file as it really is on disk (a truncated slab loses its tail).
    A key recorded twice keeps its newest record (the other slot is discarded)."""
    scan = IndexScan()
    by_key: dict[bytes, SlotRecord] = {}
    with parsing(where):
        for slot in range(min(nslots, len(raw) // RECORD_BYTES)):
            chunk = raw[slot * RECORD_BYTES:(slot + 1) * RECORD_BYTES]
            if chunk == FREE_RECORD:
                continue
            rec = _record(chunk, slot)
            if isinstance(rec, str):
                scan.discard(rec)
            elif not usable(slot):
                scan.discard("slot beyond the end of a truncated slab")
            elif rec.key in by_key:
                scan.discard("key recorded twice")
                if rec.seq > by_key[rec.key].seq:
                    by_key[rec.key] = rec
            else:
                by_key[rec.key] = rec
    scan.records = sorted(by_key.values(), key=lambda r: r.seq)
    return scan


__all__ = [
    "FORMAT", "FREE_RECORD", "HEADER_NAME", "INDEX_NAME", "LOCK_NAME", "MAX_SLOTS", "RECORD_BYTES", "VERSION",
    "Geometry", "Header", "IndexScan", "SlotRecord", "parse_header", "parse_index", "slab_name",
]
