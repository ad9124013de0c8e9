"""Restoring from node copies: what each rank holds of which step on its tier 0 (``inventory``),
the steps every rank's part can be gathered for (``plan_steps``), fetching the parts a rank lacks
from buddy copies (``fetch_step``) and the manifest of a step found only on node tiers
(``NodeCopies``). Sending the copies is ``ckpt.promotion.buddy``.

Without buddy copies (an inactive ``Buddy``: no link) the same path restores a step whose every
rank's own part is on its node's tier 0, such as an emergency save taken on a preemption that
exited before the step reached the shared tier (``ckpt.preempt``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierio.errors import FormatError, IntegrityError, StorageError, TierioError
from tierio.format.manifest import Manifest, RecordRef, check_globals, parse_record_head, utc_now
from tierio.format.shard import parse_record_name, parse_step_dir, shard_name, step_dir, step_key
from tierio.io.checksum import xxh3
from tierio.storage.base import Store, list_sizes, read_bytes

from tierio.ckpt.promotion.buddy import BUDDY_DIR, Buddy, Parcel, check_parcel, parcel_room, read_parcel, store_parcel, transfer
from tierio.ckpt.promotion.cluster import Own
from tierio.ckpt.steps.commit import check_record
from tierio.ckpt.promotion.nodes import gather
from tierio.ckpt.steps.lineage import Lineage
from tierio.ckpt.steps.reader import step_dirs
from tierio.ckpt.tier import TierState

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


def inventory(store: Store, rank: int, held: bool = True) -> list[Part]:
    """What this rank can read on its node's tier 0: its own records (its copies) and, with
    ``held``, every buddy copy's record (one listing each)."""
    parts = []
    for step, keys in step_dirs(store).items():
        for key in keys:
            rn = parse_record_name(key.rsplit("/", 1)[-1])
            if rn is not None and rn.rank == rank:
                parts.append(Part(rank, step, rn.token, key, rank))
    for key in list_sizes(store, BUDDY_DIR + "/") if held else ():
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
    rank, step = buddy.rank, plan.step
    fetches = plan.fetches()
    if not fetches:  # every rank has its own copy (the same plan on every rank: all skip the transfer)
        return None
    link = buddy.link
    assert link is not None
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
    # What the manifest will say once the step is published: the run and reason its records carry.
    label = f"rank 0's record of step {step}"
    lineage = Lineage.parse(parse_record_head(records[0][2], label).extra, label)  # type: ignore[index]
    stamp, ts = utc_now()
    man = Manifest(step, world_size, entries, stamp, ts, lineage.extra() if lineage else {}, None)
    check_globals(man, f"step {step} from node copies")
    return man


@dataclass
class NodeCopies:
    """The steps that node copies restore, agreed by every rank (``agree``): for such a step the
    restore takes its manifest from here instead of from a shared tier."""

    buddy: Buddy
    plans: dict[int, StepPlan]
    group: Any
    records: dict[int, RecordRef] = field(default_factory=dict)  # step -> this rank's record on its tier 0
    built: dict[int, Manifest] = field(default_factory=dict)  # step -> the manifest built from the records

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
        man = node_manifest(step, b.world_size, records)
        name, raw = records[b.rank][1:]
        self.records[step], self.built[step] = RecordRef(name, len(raw), xxh3(raw)), man
        return man

    def publication(self, step: int, run: str) -> tuple[Own, Lineage]:
        """What publishing ``step`` (restored from node copies) takes: this rank's part, and the
        lineage its records carry (else one of ``run``, this run)."""
        man = self.built[step]
        lineage = Lineage.of(man, f"step {step} from node copies") or Lineage(run)
        return Own(man.ranks[self.buddy.rank], self.records[step]), lineage


def node_copies(tier0: TierState, rank: int, world_size: int, buddy: Buddy | None, group: Any,
                shared: Sequence[int]) -> NodeCopies | None:
    """With a node-local tier 0 (else None): ``agree`` on the steps node copies restore, each rank's
    own parts only without buddy copies. Ranks that cannot agree (no group) never use them."""
    if not tier0.node_local or (group is None and world_size > 1):
        return None
    buddy = buddy if buddy is not None else Buddy(tier0.store, rank, world_size, None, None)
    buddy.idle()  # the buddy group is this thread's now
    return agree(buddy, group, shared)


def agree(buddy: Buddy, group: Any, shared: Sequence[int]) -> NodeCopies:
    """Which steps node copies restore (one all_gather_object over ``group``, in the caller's
    thread): those every rank's part of is on some node's tier 0, and that not every rank finds on
    a shared tier (``shared``: the steps this rank finds there)."""
    try:
        mine = inventory(buddy.store, buddy.rank, held=buddy.active)
    except StorageError as exc:
        log.warning("cannot list the node copies on %s: %s", buddy.store.url, exc)
        mine = []
    found = gather((mine, sorted(shared)), group, buddy.world_size)
    everywhere = set.intersection(*(set(s) for _, s in found))
    parts = [p for p, _ in found]
    plans = {s: p for s, p in plan_steps(parts, buddy.world_size).items() if s not in everywhere}
    if buddy.rank == 0:
        say_incomplete(parts, buddy.world_size, max(everywhere | set(plans), default=-1))
    return NodeCopies(buddy, plans, group)


def say_incomplete(found: Sequence[Sequence[Part]], world_size: int, newest: int) -> None:
    """Log the steps newer than ``newest`` (the newest one every rank can restore) that some ranks'
    node tiers hold but not every rank's: why the restore goes back further than they are."""
    have: dict[int, set[int]] = {}
    for parts in found:
        for p in parts:
            if p.step > newest and 0 <= p.rank < world_size:
                have.setdefault(p.step, set()).add(p.rank)
    for step, ranks in sorted(have.items()):
        missing = sorted(set(range(world_size)) - ranks)
        why = (f"no part of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} is on its node's "
               "tier 0: the node lost it, or the rank never saved it") if missing else "its parts come from different runs"
        log.warning("step %d is on node-local tiers but cannot be restored (%s); an older step is", step, why)
