"""What an NVMe KV tier holds, read without opening it for use: no lock taken, nothing created or
changed, so it can look at the directory of a server that is running (a record being written at
that moment may read as torn: it is counted, not trusted)."""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

from tierio.errors import FormatError, NotFoundError, TierioError
from tierio.io.buffers import HostBuffer
from tierio.io.files import os_error, pread_full, read_into
from tierio.io.paths import open_beneath
from tierio.kv.tiers.shared import block_checksum
from tierio.kv.tiers.slab import read_header
from tierio.kv.tiers.slabindex import INDEX_NAME, LOCK_NAME, RECORD_BYTES, Geometry, SlotRecord, parse_index, slab_name
from tierio.stats import Stats


@dataclass
class TierReport(Stats):
    directory: str
    geometry: Geometry
    layout: dict
    blocks: int                 # committed blocks
    chains: int                 # blocks whose parent is not in the tier: where chains start
    discarded: int              # records found torn, damaged, duplicated or beyond a slab's end
    reasons: dict[str, int] = field(default_factory=dict)
    owner: str | None = None    # pid of the process using the tier, if one is
    verified: int | None = None  # with verify: blocks whose bytes match their checksum
    damaged: list[int] = field(default_factory=list)  # with verify: slots whose bytes do not

    @property
    def used_bytes(self) -> int:
        return self.blocks * self.geometry.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.geometry.nslots * self.geometry.slot_bytes

    def to_dict(self) -> dict:  # the geometry flattened, as `tierio kv stats --json` has always printed it
        g = self.geometry
        return {"directory": self.directory, "layout": self.layout, "block_bytes": g.block_bytes, "slot_bytes": g.slot_bytes,
                "slots_per_slab": g.slots_per_slab, "slabs": g.slabs, "slots": g.nslots, "blocks": self.blocks,
                "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes, "chains": self.chains,
                "discarded": self.discarded, "reasons": self.reasons, "owner": self.owner, "verified": self.verified,
                "damaged_slots": self.damaged}


def _owner(directory: Path) -> str | None:
    try:
        fd = open_beneath(directory, LOCK_NAME)
    except (NotFoundError, FormatError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def _slab_sizes(directory: Path, g: Geometry) -> list[int]:
    sizes = []
    for i in range(g.slabs):
        try:
            fd = open_beneath(directory, slab_name(i))
        except NotFoundError:
            sizes.append(0)
            continue
        sizes.append(os.fstat(fd).st_size)
        os.close(fd)
    return sizes


def inspect_tier(directory: str | Path, *, verify: bool = False) -> TierReport:
    """Read a tier's header and index (and with ``verify`` every block) and say what it holds."""
    directory = Path(directory)
    header = read_header(directory)
    if header is None:
        raise NotFoundError(f"{directory} holds no NVMe KV tier ({directory}/kvtier.json is missing); "
                            "a tier is made by a KVCache with nvme_dir set")
    g = header.geometry
    sizes = _slab_sizes(directory, g)
    fd = open_beneath(directory, INDEX_NAME)
    try:
        raw = bytearray(min(os.fstat(fd).st_size, g.nslots * RECORD_BYTES))
        got = pread_full(fd, memoryview(raw), 0, directory / INDEX_NAME)
    except OSError as exc:
        raise os_error(exc, directory / INDEX_NAME, "reading") from exc
    finally:
        os.close(fd)

    def usable(slot: int) -> bool:
        slab, at = divmod(slot, g.slots_per_slab)
        return slab < len(sizes) and (at + 1) * g.slot_bytes <= sizes[slab]

    scan = parse_index(bytes(raw[:got]), str(directory / INDEX_NAME), g.nslots, usable)
    keys = {r.key for r in scan.records}
    report = TierReport(str(directory), g, header.layout, len(scan.records),
                        sum(1 for r in scan.records if r.parent not in keys), scan.discarded, scan.reasons,
                        _owner(directory))
    if verify:
        report.verified, report.damaged = _verify(directory, g, scan.records)
    return report


def _verify(directory: Path, g: Geometry, records: list[SlotRecord]) -> tuple[int, list[int]]:
    buf = HostBuffer(g.slot_bytes)
    ok, damaged = 0, []
    for rec in records:
        slab, offset = g.locate(rec.slot)
        try:
            read_into(directory / slab_name(slab), offset, buf.view[:g.block_bytes])
            good = block_checksum(buf.array[:g.block_bytes]) == rec.checksum
        except TierioError:
            good = False
        ok += good
        if not good:
            damaged.append(rec.slot)
    return ok, damaged


__all__ = ["TierReport", "inspect_tier"]
