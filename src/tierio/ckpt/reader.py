"""Reading checkpoints from one store: listing, manifests, verified restore and verification.

Restore reads each tensor's bytes with large parallel requests straight into their final memory:
into the caller's tensors when ``into=`` names matching CPU tensors, else into one fresh aligned
buffer that the returned tensors view (no second copy). Every chunk is checked against its xxh3
before the state is handed back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError, StorageError, TierioError
from tierio.format.manifest import MAX_MANIFEST_BYTES, Manifest, RankEntry, TensorInfo, parse_manifest
from tierio.format.safetensors import read_header_from, torch_dtype
from tierio.format.shard import manifest_key, parse_step_dir, step_dir
from tierio.format.statetree import unflatten
from tierio.io.buffers import HostBuffer
from tierio.io.checksum import verify as verify_checksum
from tierio.io.checksum import xxh3
from tierio.io.untrusted import parsing
from tierio.storage.base import Store, read_bytes
from tierio.storage.scatter import read_scatter

log = logging.getLogger(__name__)



def where(store: Store, key: str) -> str:
    return f"{store.url.split('?')[0].rstrip('/')}/{key}"


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


def read_manifest_bytes(store: Store, step: int) -> bytes:
    key = manifest_key(step)
    size = store.stat(key).size
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where(store, key)} is {size} bytes, above the {MAX_MANIFEST_BYTES}-byte limit; it is corrupt or hostile")
    return read_bytes(store, key, 0, size)


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
        e = header.tensors.get(t.name)
        if e is None or e.dtype != t.dtype:
            raise IntegrityError(f"{w}: tensor {t.name!r} is missing from the shard header or has another dtype")
        lo, hi = header.data_offset + e.begin, header.data_offset + e.end
        if any(c.begin < lo or c.end > hi for c in t.chunks):
            raise IntegrityError(f"{w}: the chunks of tensor {t.name!r} lie outside its bytes in the shard header")


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _direct_target(target: torch.Tensor | None, info: TensorInfo) -> bool:
    return (
        target is not None
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == torch_dtype(info.dtype)
        and tuple(target.shape) == info.shape
        and target.numel() > 0
    )


def _check_target(target: torch.Tensor, info: TensorInfo, name: str) -> None:
    if tuple(target.shape) != info.shape or target.dtype != torch_dtype(info.dtype):
        raise ConfigError(
            f"into= tensor for {name!r} has shape {list(target.shape)} and dtype {target.dtype}; the checkpoint holds "
            f"{list(info.shape)} {torch_dtype(info.dtype)}; pass a matching tensor or restore without into="
        )


def load_rank(store: Store, manifest: Manifest, rank: int, into: Any = None, *, verify: bool = True) -> Any:
    """Restore rank ``rank``'s state tree from ``store`` (every chunk verified)."""
    entry = manifest.ranks[rank]
    step = manifest.step
    key = f"{step_dir(step)}/{entry.file}"
    w = where(store, key)
    check_shard(store, step, entry)
    if any(c.offsets != (0,) * len(c.offsets) or t.shape != _local_shape(t) for t in entry.tensors.values() for c in t.chunks[:1]):
        raise FormatError(f"{w}: holds slices of larger tensors; restoring them needs resharding, which this version cannot do")

    # Pass 1: find what in ``into`` each tensor should land in.
    targets: dict[str, torch.Tensor | None] = {}

    def note(name: str, target: torch.Tensor | None) -> torch.Tensor:
        if name not in entry.tensors:
            raise FormatError(f"{w}: state tree refers to unknown tensor {name!r}")
        if targets.get(name) is None:
            targets[name] = target
        return torch.empty(0)

    with parsing(f"{w}: the state tree of its manifest"):  # a hostile tree is a bad copy, not a crash
        unflatten(entry.tree, note, into)

    # Pass 2: read. Matching CPU targets receive their bytes in place; every other tensor gets a
    # fresh contiguous tensor of the stored dtype (copied into its target, if any, in pass 3).
    views: dict[str, memoryview] = {}
    fresh: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, memoryview]] = []
    for name, tgt in targets.items():
        info = entry.tensors[name]
        if tgt is not None:
            _check_target(tgt, info, name)
        if _direct_target(tgt, info):
            views[name] = _byte_view(tgt)
        elif info.nbytes:
            fresh[name] = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
            views[name] = _byte_view(fresh[name])
        else:
            views[name] = memoryview(b"")
        if info.nbytes:
            spans.append((info.chunks[0].begin, views[name]))
    read_scatter(store, key, spans)

    if verify:
        for name in targets:
            info = entry.tensors[name]
            start = info.chunks[0].begin
            for i, c in enumerate(info.chunks):
                verify_checksum(views[name][c.begin - start : c.end - start], c.xxh3,
                                f"{w}, tensor {name!r} chunk {i} (bytes {c.begin}..{c.end})")

    # Pass 3: build the state; tied tensors come back as one object.
    made: dict[str, torch.Tensor] = {}

    def get(name: str, target: torch.Tensor | None) -> torch.Tensor:
        if name in made:
            return made[name]
        info = entry.tensors[name]
        dtype = torch_dtype(info.dtype)
        tgt = targets.get(name)
        if tgt is not None and _direct_target(tgt, info):
            out = tgt
        else:
            src = fresh[name] if name in fresh else torch.empty(info.shape, dtype=dtype)
            if tgt is not None:
                with torch.no_grad():
                    tgt.copy_(src)
                out = tgt
            else:
                out = src
        made[name] = out
        return out

    with parsing(f"{w}: the state tree of its manifest"):
        return unflatten(entry.tree, get, into)


def _local_shape(t: TensorInfo) -> tuple[int, ...]:
    """Shape covered by this rank's chunks (rows concatenated along dim 0)."""
    if len(t.chunks) == 1:
        return t.chunks[0].shape
    first = t.chunks[0].shape
    return (sum(c.shape[0] for c in t.chunks), *first[1:])


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
class VerifyReport:
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


def verify_copy(store: Store, step: int, report: VerifyReport, chunk_buf_bytes: int = 64 << 20) -> None:
    """Check one store's copy of ``step`` byte for byte; problems are added to ``report``."""
    tier = store.url
    mkey = manifest_key(step)
    before = len(report.problems)
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
    buf: HostBuffer | None = None
    for entry in man.ranks:
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
                try:
                    if buf is None or buf.capacity < c.nbytes:
                        buf = HostBuffer(max(c.nbytes, min(chunk_buf_bytes, entry.bytes)), prefault=False)
                    view = buf.view[: c.nbytes]
                    if c.nbytes:
                        store.read_into(key, c.begin, view)
                    report.bytes_checked += c.nbytes
                    got = xxh3(view)
                    if got != c.xxh3:
                        report.problems.append(Problem(tier, key, cname, f"checksum mismatch: expected xxh3 {c.xxh3}, got {got}"))
                except TierioError as exc:
                    report.problems.append(Problem(tier, key, cname, str(exc)))
    report.copies[tier] = "bad" if len(report.problems) > before else "ok"

