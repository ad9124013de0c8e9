"""Restoring from buddy copies: what each rank holds of which step on its tier 0 (``inventory``),
the steps every rank's part can be gathered for (``plan_steps``), fetching the parts a rank lacks
(``fetch_step``) and the manifest of a step found only on node tiers (``NodeCopies``). Sending the
copies is ``ckpt.promotion.buddy``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierio.errors import FormatError, IntegrityError, StorageError, TierioError
from tierio.format.manifest import Manifest, check_globals, utc_now
from tierio.format.shard import parse_record_name, parse_step_dir, shard_name, step_dir, step_key
from tierio.storage.base import Store, list_sizes, read_bytes

from tierio.ckpt.promotion.buddy import BUDDY_DIR, Buddy, Parcel, check_parcel, parcel_room, read_parcel, store_parcel, transfer
from tierio.ckpt.steps.commit import check_record
from tierio.ckpt.promotion.nodes import gather
from tierio.ckpt.steps.reader import step_dirs

log = logging.getLogger("tierio.ckpt")


@dataclass(frozen=True)
class Part:
    """A rank's record of a step on some node's tier 0: its own copy, or a buddy copy ``holder`` keeps."""

    rank: int
    step: int
    token: str
    key: str  # the record's key on the holder's tier 0
    holder: int

    @property
    def held(self) -> bool:
        return self.key.startswith(BUDDY_DIR + "/")


def inventory(store: Store, rank: int) -> list[Part]:
    """What this rank can read on its node's tier 0: its own records (its copies) and every buddy
    copy's record (one listing each)."""
    parts = []
    for step, keys in step_dirs(store).items():
        for key in keys:
            rn = parse_record_name(key.rsplit("/", 1)[-1])
            if rn is not None and rn.rank == rank:
                parts.append(Part(rank, step, rn.token, key, rank))
    for key in list_sizes(store, BUDDY_DIR + "/"):
        bits = key.split("/")
        rn = parse_record_name(bits[-1])
        step = parse_step_dir(bits[-2]) if len(bits) == 4 else None
        if rn is not None and step is not None:
            parts.append(Part(rn.rank, step, rn.token, key, rank))
    return parts


@dataclass(frozen=True)
class StepPlan:
    """A step every rank can restore from node copies: where each rank's part is."""

    step: int
    parts: dict[int, Part]  # rank -> its own copy where it has one, else the held copy it fetches

    def fetches(self) -> dict[int, Part]:
        return {r: p for r, p in self.parts.items() if p.holder != r}


def plan_steps(found: Sequence[Sequence[Part]], world_size: int) -> dict[int, StepPlan]:
    """The steps whose every rank's part (of one run) is on some node's tier 0, given every rank's
    inventory: each rank's own copy where it has one, else the held copy of the lowest holder."""
    best: dict[tuple[int, str], dict[int, Part]] = {}
    for parts in found:
        for p in parts:
            if not 0 <= p.rank < world_size:
                continue  # saved with another world size: node copies restore only the same one
            have = best.setdefault((p.step, p.token), {})
            old = have.get(p.rank)
            if old is None or (old.held and (not p.held or p.holder < old.holder)):
                have[p.rank] = p
    plans: dict[int, StepPlan] = {}
    for (step, _token), have in sorted(best.items()):
        if len(have) == world_size and step not in plans:
            plans[step] = StepPlan(step, have)
    return plans


def fetch_step(buddy: Buddy, plan: StepPlan) -> Exception | None:
    """Every rank, in the caller's thread: holders send the copies that ranks without their own
    copy need, and such a rank verifies its copy and writes it back into its node's tier 0. Returns
    this rank's failure (the others must hear of it, so it is not raised here)."""
    link = buddy.link
    assert link is not None
    rank, step = buddy.rank, plan.step
    fetches = plan.fetches()
    sends: list[tuple[int, Parcel | None]] = []
    for r, part in sorted(fetches.items()):
        if part.holder != rank:
            continue
        try:
            sends.append((r, read_parcel(buddy.store, step, part.key, part.key.rsplit("/", 1)[0] + "/" + shard_name(r))))
        except TierioError as exc:
            log.warning("cannot send rank %d's buddy copy of step %d from %s: %s", r, step, buddy.store.url, exc)
            sends.append((r, None))
    mine = fetches.get(rank)
    try:
        got = transfer(link, sends, mine.holder if mine is not None else None, parcel_room(buddy.store))
    except (RuntimeError, FormatError) as exc:
        return StorageError(f"rank {rank}: the buddy transfer of step {step} failed: {exc}")
    if mine is None:
        return None
    label = f"the buddy copy of rank {rank}'s step {step} held by rank {mine.holder} ({mine.key})"
    if got is None:
        return IntegrityError(f"{label} could not be read there; step {step} cannot be restored on rank {rank}")
    try:
        entry = check_parcel(got, rank, buddy.world_size, label)
        store_parcel(buddy.store, step_dir(step), got, entry)
    except (FormatError, IntegrityError, StorageError) as exc:
        return exc
    log.info("rank %d: step %d's shard came from the buddy copy held by rank %d; written back to %s",
             rank, step, mine.holder, buddy.store.url)
    return None


def node_manifest(step: int, world_size: int, records: Sequence[tuple[int, str, bytes] | str]) -> Manifest:
    """The manifest of a step restored from node copies, from every rank's record (``(rank, name,
    raw)``, or the reason that rank has none), checked as a committed manifest would be."""
    problems = [f"rank {r}: {x}" for r, x in enumerate(records) if isinstance(x, str)]
    if problems:
        raise IntegrityError(f"step {step} cannot be restored from node copies: " + "; ".join(problems))
    entries = []
    for r, item in enumerate(records):
        assert not isinstance(item, str)
        _, name, raw = item
        rn = parse_record_name(name)
        if rn is None or rn.rank != r:
            raise IntegrityError(f"step {step}: {name!r} is not a record of rank {r}; not restoring it")
        entries.append(check_record(raw, rn.digest, "name", f"rank {r}'s record {name} of step {step}", step, world_size,
                                    "not restoring it", r))
    stamp, ts = utc_now()
    man = Manifest(step, world_size, entries, stamp, ts, {}, None)
    check_globals(man, f"step {step} from node copies")
    return man


@dataclass
class NodeCopies:
    """The steps that node copies restore, agreed by every rank (``agree``): for such a step the
    restore takes its manifest from here instead of from a shared tier."""

    buddy: Buddy
    plans: dict[int, StepPlan]
    group: Any

    def manifest(self, step: int) -> Manifest:
        """Fetch this rank's part if it has no copy of its own, then build the step's manifest from
        every rank's record (one all_gather_object). Every rank calls it for the same step."""
        b = self.buddy
        failure = fetch_step(b, self.plans[step])
        record: tuple[int, str, bytes] | str
        if failure is not None:
            record = str(failure)
        else:
            name = self.plans[step].parts[b.rank].key.rsplit("/", 1)[-1]
            try:
                record = (b.rank, name, read_bytes(b.store, step_key(step, name)))
            except TierioError as exc:
                record = str(exc)
        records = gather(record, self.group, b.world_size)
        if failure is not None:
            raise failure
        return node_manifest(step, b.world_size, records)


def agree(buddy: Buddy, group: Any, shared: Sequence[int]) -> NodeCopies:
    """Which steps node copies restore (one all_gather_object over ``group``, in the caller's
    thread): those every rank's part of is on some node's tier 0, and that not every rank finds on
    a shared tier (``shared``: the steps this rank finds there)."""
    try:
        mine = inventory(buddy.store, buddy.rank)
    except StorageError as exc:
        log.warning("cannot list the node copies on %s: %s", buddy.store.url, exc)
        mine = []
    found = gather((mine, sorted(shared)), group, buddy.world_size)
    everywhere = set.intersection(*(set(s) for _, s in found))
    plans = {s: p for s, p in plan_steps([parts for parts, _ in found], buddy.world_size).items() if s not in everywhere}
    return NodeCopies(buddy, plans, group)
