"""Reading checkpoints from one store: listings, manifests, shard checks and verification.

(Restoring state is ``ckpt.restore.load``; which chunks a restore reads is ``ckpt.restore.reshard``.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tierio.errors import FormatError, IntegrityError, NotFoundError, StorageError, TierioError
from tierio.format.manifest import Manifest, RankEntry, file_key, parse_manifest
from tierio.format.safetensors import read_header_from
from tierio.format.shard import manifest_key, parse_step_dir, step_dir
from tierio.io.buffers import HostBuffer
from tierio.io.checksum import xxh3
from tierio.storage.base import Store, read_bytes, where
from tierio.stats import Stats

from tierio.ckpt.steps.commit import read_manifest_bytes, read_record
from tierio.ckpt.tier import TierState

log = logging.getLogger(__name__)


def step_dirs(store: Store) -> dict[int, list[str]]:
    """Every step directory on ``store`` (committed or not) with its keys: one listing."""
    out: dict[int, list[str]] = {}
    for key in store.list("step_"):
        s = parse_step_dir(key.split("/", 1)[0])
        if s is not None:
            out.setdefault(s, []).append(key)
    return out


def committed_in(dirs: dict[int, list[str]]) -> list[int]:
    """The steps of a ``step_dirs`` listing that hold a manifest (the others are garbage)."""
    return sorted(s for s, keys in dirs.items() if manifest_key(s) in keys)


def committed_steps(store: Store) -> list[int]:
    """Steps with a manifest on ``store`` (a directory without one is garbage, never listed)."""
    return committed_in(step_dirs(store))


def commit_times(store: Store, steps: list[int]) -> dict[int, float]:
    """When each step was committed (its manifest's mtime), as retention wants them."""
    return {s: store.stat(manifest_key(s)).mtime for s in steps}


def read_manifest_raw(store: Store, step: int) -> tuple[bytes, Manifest]:
    """The manifest's bytes (to copy them unchanged) and what they say."""
    raw = read_manifest_bytes(store, step)
    return raw, parse_manifest(raw, where(store, manifest_key(step)), expect_step=step)


def read_manifest(store: Store, step: int) -> Manifest:
    return read_manifest_raw(store, step)[1]


def check_shard(store: Store, step: int, entry: RankEntry) -> None:
    """The shard exists with the recorded size and its safetensors header agrees with the manifest."""
    key = f"{step_dir(step)}/{entry.file}"
    w = where(store, key)
    size = store.stat(key).size
    if size != entry.bytes:
        raise IntegrityError(f"{w} is {size} bytes but the manifest records {entry.bytes}: the file is truncated or was replaced")
    header = read_header_from(lambda offset, n: read_bytes(store, key, offset, n), size, w)
    for t in entry.tensors.values():
        if all(c.is_ref for c in t.chunks):
            continue  # an unchanged tensor of an incremental checkpoint: its bytes are in an earlier shard
        e = header.tensors.get(t.name)
        if e is None or e.dtype != t.dtype:
            raise IntegrityError(f"{w}: tensor {t.name!r} is missing from the shard header or has another dtype")
        lo, hi = header.data_offset + e.begin, header.data_offset + e.end
        if any(c.begin < lo or c.end > hi for c in t.chunks if not c.is_ref):
            raise IntegrityError(f"{w}: the chunks of tensor {t.name!r} lie outside its bytes in the shard header")


# -- verification ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    tier: str
    file: str
    chunk: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.tier}: {self.file}" + (f" [{self.chunk}]" if self.chunk else "") + f": {self.message}"


@dataclass
class VerifyReport(Stats):
    step: int
    copies: dict[str, str] = field(default_factory=dict)  # tier url -> "ok" | "bad" | "absent"
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        """At least one copy exists and no copy has a problem."""
        return not self.problems and any(v == "ok" for v in self.copies.values())

    @property
    def good_tiers(self) -> list[str]:
        return [t for t, v in self.copies.items() if v == "ok"]

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "ok": self.ok,
            "copies": self.copies,
            "bytes_checked": self.bytes_checked,
            "problems": [{"tier": p.tier, "file": p.file, "chunk": p.chunk, "message": p.message} for p in self.problems],
        }


def verify_copy(store: Store, step: int, report: VerifyReport, chunk_buf_bytes: int = 64 << 20, *,
                manifest: Manifest | None = None) -> None:
    """Check one store's copy of ``step`` byte for byte; problems are added to ``report``.

    With ``manifest`` (the step's, from a shared tier), ``store`` is a node-local tier: the files
    of the ranks it holds are checked, the others are not expected there."""
    tier = store.url
    mkey = manifest_key(step)
    before = len(report.problems)
    if manifest is not None:
        checked = report.bytes_checked
        _verify_files(store, manifest, report, chunk_buf_bytes, node_local=True)
        report.copies[tier] = "bad" if len(report.problems) > before else ("ok" if report.bytes_checked > checked else "absent")
        return
    try:
        if not store.exists(mkey):
            if store.list(step_dir(step) + "/"):
                report.problems.append(Problem(tier, mkey, None, "no manifest: the directory is an uncommitted (partial) checkpoint"))
                report.copies[tier] = "bad"
            else:
                report.copies[tier] = "absent"
            return
        man = read_manifest(store, step)
    except (FormatError, IntegrityError, StorageError) as exc:
        report.problems.append(Problem(tier, mkey, None, str(exc)))
        report.copies[tier] = "bad"
        return
    _verify_files(store, man, report, chunk_buf_bytes)
    report.copies[tier] = "bad" if len(report.problems) > before else "ok"


def _verify_files(store: Store, man: Manifest, report: VerifyReport, chunk_buf_bytes: int, node_local: bool = False) -> None:
    tier, step = store.url, man.step
    buf: HostBuffer | None = None
    for entry in man.ranks:
        if node_local and not store.exists(f"{step_dir(step)}/{entry.file}"):
            continue  # another node's rank
        if entry.record is not None:
            try:
                entry = read_record(store, step, man.world_size, entry.record)
            except NotFoundError:
                report.problems.append(Problem(tier, f"{step_dir(step)}/{entry.record.name}", None, "record file is missing"))
                continue
            except TierioError as exc:
                report.problems.append(Problem(tier, f"{step_dir(step)}/{entry.record.name}", None, str(exc)))
                continue
        key = f"{step_dir(step)}/{entry.file}"
        try:
            check_shard(store, step, entry)
        except NotFoundError:
            report.problems.append(Problem(tier, key, None, "shard file is missing"))
            continue
        except TierioError as exc:
            report.problems.append(Problem(tier, key, None, str(exc)))
            continue
        for t in entry.tensors.values():
            for i, c in enumerate(t.chunks):
                cname = f"tensor {t.name!r} chunk {i} bytes {c.begin}..{c.end}"
                ckey = file_key(step, c.file)  # an incremental checkpoint's chunk may lie in an earlier step's shard
                try:
                    if buf is None or buf.capacity < c.nbytes:
                        buf = HostBuffer(max(c.nbytes, min(chunk_buf_bytes, entry.bytes)), prefault=False)
                    view = buf.view[: c.nbytes]
                    if c.nbytes:
                        store.read_into(ckey, c.begin, view)
                    report.bytes_checked += c.nbytes
                    got = xxh3(view)
                    if got != c.xxh3:
                        report.problems.append(Problem(tier, ckey, cname, f"checksum mismatch: expected xxh3 {c.xxh3}, got {got}"
                                                       + (f" (referred to by step {step})" if c.is_ref else "")))
                except NotFoundError as exc:
                    msg = (f"dangling reference: step {step} rank {entry.rank} tensor {t.name!r} refers to {ckey}, which is "
                           "missing on this tier" if c.is_ref else str(exc))
                    report.problems.append(Problem(tier, ckey, cname, msg))
                except TierioError as exc:
                    report.problems.append(Problem(tier, ckey, cname, str(exc)))



def steps_on(tiers: list[TierState]) -> list[int]:
    """Committed steps on any shared tier (a node's copies are committed where the manifest is);
    an unreachable tier is skipped with a warning."""
    out: set[int] = set()
    for ts in tiers:
        if ts.node_local:
            continue
        try:
            out.update(committed_steps(ts.store))
        except StorageError as exc:
            log.warning("cannot list %s: %s", ts.url, exc)
    return sorted(out)


def verify_tiers(tiers: list[TierState], step: int) -> VerifyReport:
    """Every tier's copy of ``step`` checked byte for byte (on a node-local tier, this node's files
    of it, against the manifest of the first shared tier holding one)."""
    report = VerifyReport(step)
    shared = [ts for ts in tiers if not ts.node_local]
    for ts in tiers:
        man = None
        if ts.node_local:
            man = next((read_manifest(s.store, step) for s in shared if s.store.exists(manifest_key(step))), None)
        verify_copy(ts.store, step, report, manifest=man)
    return report
