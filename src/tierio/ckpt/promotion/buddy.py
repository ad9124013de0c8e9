"""Buddy copies: each node's shards of a step also on a partner node's tier 0, for losing a node.

With a node-local tier 0, a step is on the shared tier only once every node has published it there,
and a node that dies before that takes its ranks' shards with it. With ``buddy=True`` each rank
also sends its shard and record of every step it saved to its partner: the rank of the same local
index on the next node (node i -> node (i + 1) % nodes, nodes ordered by their lowest rank). The
partner verifies every chunk against the record and keeps the copy under its own tier 0, at
``buddy/<source node>/step_<n>/`` (the record last: a copy counts once its record is there);
tier 0's retention applies to the copies of each source node, and a rollback retires the copies
of the abandoned steps as it does the node's own.

Transport: ``torch.distributed`` point-to-point over a gloo group made for this alone (``new_group``
at construction, in the caller's thread, by every rank). After construction only the buddy thread
uses that group while saves run, and the caller's thread uses it in ``restore`` once the buddy
thread is idle: one user at a time, so its messages never interleave and no collective of the
training group ever runs on a background thread. Every step costs each rank one exchange with its
two neighbours (a header, then the bytes), under its own bandwidth limit; a save that fails or is
refused sends an empty header, so the partner never waits for bytes that will not come and the
exchanges stay in step.

Restore: a step that is not on the shared tier yet is restorable when each rank's record of it
(of one run) is on its node's tier 0 or held by a buddy, with the world size of the save. The
holder sends the copy to the rank over the buddy group (in the caller's thread, every rank taking
part); the rank verifies it and writes it back to its node's (new) tier 0, then reads as usual
(``ckpt.promotion.buddy_restore``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tierio.dist import release_group
from tierio.errors import ConfigError, FormatError, IntegrityError, TierioError
from tierio.format.manifest import MAX_MANIFEST_BYTES, RankEntry
from tierio.format.shard import parse_record_name, parse_step_dir, shard_name, step_dir, step_key
from tierio.io import background
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store, read_bytes
from tierio.units import fmt_bytes

from tierio.ckpt.steps.commit import check_record
from tierio.ckpt.promotion.copy import verify_chunks
from tierio.ckpt.steps.retention import Retention, wanted

log = logging.getLogger("tierio.ckpt")

BUDDY_DIR = "buddy"
_NODE_DIR = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_NOTHING = -1  # a header's step when no copy follows (the save failed, the copy is unreadable)


@dataclass(frozen=True)
class Pairing:
    """Who this rank sends its copies to and whose copies it keeps (None: one node, no copies)."""

    nodes: int
    partner: int | None
    source: int | None
    source_node: str = ""

    @property
    def active(self) -> bool:
        return self.partner is not None


def check_buddy(node_local: bool, incremental: bool) -> None:
    """ConfigError where buddy copies cannot work: a shared tier 0, or incremental steps."""
    if not node_local:
        raise ConfigError("buddy=True copies each node's tier 0 to another node: it needs a node-local tier 0, "
                          "e.g. Tier('/nvme/ckpt', scope='node')")
    if incremental:  # a buddy copy carries one shard, not the earlier shards it refers to
        raise ConfigError("buddy=True and incremental=True cannot be combined: a buddy copy holds one step's "
                          "shard, not the earlier shards an incremental step refers to; choose one")


def pair(names: Sequence[str], rank: int) -> Pairing:
    """The pairing of ``rank``, given every rank's node name: node i sends to node (i + 1) % nodes,
    each rank to the rank of the same local index there."""
    order: dict[str, list[int]] = {}
    for r, n in enumerate(names):
        order.setdefault(n, []).append(r)
    nodes = list(order.values())  # ordered by their lowest rank (insertion order)
    if len(nodes) == 1:
        return Pairing(1, None, None)
    sizes = {len(n) for n in nodes}
    if len(sizes) != 1:
        raise ConfigError(f"buddy copies need the same number of ranks on every node; got {sorted(len(n) for n in nodes)} "
                          "ranks on the nodes")
    i = next(k for k, n in enumerate(nodes) if rank in n)
    j = nodes[i].index(rank)
    src = (i - 1) % len(nodes)
    source_node = names[nodes[src][j]]
    if not _NODE_DIR.fullmatch(source_node) or ".." in source_node:
        raise ConfigError(f"node name {source_node!r} cannot name a directory of buddy copies: use letters, digits, "
                          "'_', '-' and '.' (the node= option or TIERIO_NODE)")
    return Pairing(len(nodes), nodes[(i + 1) % len(nodes)][j], nodes[src][j], source_node)


def held_dir(node: str, step: int) -> str:
    """Where a node's tier 0 keeps the copies of ``node``'s ranks' parts of ``step``."""
    return f"{BUDDY_DIR}/{node}/{step_dir(step)}"


@dataclass(frozen=True)
class Parcel:
    """One rank's part of a step as it travels: its record (file name and bytes) and its shard."""

    step: int
    name: str
    record: bytes
    shard: torch.Tensor  # uint8, the shard file byte for byte

    @property
    def nbytes(self) -> int:
        return len(self.name) + len(self.record) + self.shard.numel()


def read_parcel(store: Store, step: int, record_key: str, shard_key: str) -> Parcel:
    """A rank's record and shard as they lie on ``store`` (checked by the receiver, not here)."""
    raw = read_bytes(store, record_key)
    size = store.stat(shard_key).size
    shard = torch.empty(size, dtype=torch.uint8)
    if size:
        store.read_into(shard_key, 0, memoryview(shard.numpy()))
    return Parcel(step, record_key.rsplit("/", 1)[-1], raw, shard)


def check_parcel(parcel: Parcel, rank: int, world_size: int, label: str) -> RankEntry:
    """The record of ``parcel`` checked against its name and parsed strictly, and every chunk of the
    shard verified against it: the copy is rank ``rank``'s part of its step, intact."""
    rn = parse_record_name(parcel.name)
    if rn is None or rn.rank != rank:
        raise FormatError(f"{label}: {parcel.name!r} is not a record of rank {rank}")
    entry = check_record(parcel.record, rn.digest, "name", label, parcel.step, world_size, "refusing this copy", rank)
    if entry.bytes != parcel.shard.numel():
        raise IntegrityError(f"{label}: the shard is {parcel.shard.numel()} bytes, its record says {entry.bytes}; "
                             "refusing this copy")
    verify_chunks(memoryview(parcel.shard.numpy()), entry, label, "refusing this copy")
    return entry


def store_parcel(store: Store, base: str, parcel: Parcel, entry: RankEntry) -> None:
    """Write a verified parcel into the directory ``base``: the shard, then the record (a copy
    counts once its record is there). A record of the same rank another run left there goes
    first: it would describe a shard that is no longer there."""
    for key in store.list(base + "/"):
        rn = parse_record_name(key.rsplit("/", 1)[-1])
        if rn is not None and rn.rank == entry.rank and key.rsplit("/", 1)[-1] != parcel.name:
            store.delete(key)
    store.put_buffers(f"{base}/{entry.file}", [memoryview(parcel.shard.numpy())])
    store.put_buffers(f"{base}/{parcel.name}", [parcel.record])


@dataclass
class Link:
    """The buddy group, this rank's pairing, and the limit on what it sends."""

    group: Any
    pairing: Pairing
    limiter: TokenBucket | None


def _header(parcel: Parcel | None) -> torch.Tensor:
    if parcel is None:
        return torch.tensor([_NOTHING, 0, 0, 0], dtype=torch.int64)
    return torch.tensor([parcel.step, len(parcel.name), len(parcel.record), parcel.shard.numel()], dtype=torch.int64)


def parcel_room(store: Store) -> int:
    """The most bytes a parcel received for ``store`` (this node's tier 0) may declare: it is
    received into this host's memory and then kept on that tier, so no more than either holds."""
    room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    space = store.capacity()
    return room if space is None else min(room, space[1])


def transfer(link: Link, sends: Sequence[tuple[int, Parcel | None]], recv_from: int | None,
             room: int) -> Parcel | None:
    """Send each parcel to its rank and receive one from ``recv_from`` (None: none), in two rounds
    over the buddy group: headers, then bytes (none after an empty header). Every rank named must
    make the matching call. Returns the parcel received, None when an empty header came. A header
    is the peer's word, checked before anything is allocated: a record no larger than a manifest
    may be, a parcel of at most ``room`` bytes (``parcel_room``)."""
    import torch.distributed as dist

    g = link.group
    head_in = torch.zeros(4, dtype=torch.int64)
    ops = [dist.isend(_header(p), dst, group=g) for dst, p in sends]
    if recv_from is not None:
        ops.append(dist.irecv(head_in, recv_from, group=g))
    for op in ops:
        op.wait()
    ops = []
    for dst, p in sends:
        if p is None:
            continue
        if link.limiter is not None:
            link.limiter.consume(p.nbytes)
        ops.append(dist.isend(torch.cat([torch.frombuffer(bytearray(p.name.encode() + p.record), dtype=torch.uint8),
                                         p.shard]), dst, group=g))
    buf = None
    step, name_len, rec_len, shard_len = (int(x) for x in head_in)
    if recv_from is not None and step != _NOTHING:
        if not (0 < name_len <= 255 and 0 <= rec_len <= MAX_MANIFEST_BYTES and shard_len >= 0):
            raise FormatError(f"buddy rank {recv_from} sent a malformed header {head_in.tolist()}")
        if name_len + rec_len + shard_len > room:
            raise FormatError(
                f"buddy rank {recv_from} declared a copy of step {step} of {fmt_bytes(name_len + rec_len + shard_len)} "
                f"({shard_len} shard bytes), more than this rank can receive and keep ({fmt_bytes(room)}: this "
                "host's memory or its tier 0's free space); refused before allocating it. Free space on tier 0, "
                f"or check what rank {recv_from} saved")
        buf = torch.empty(name_len + rec_len + shard_len, dtype=torch.uint8)
        ops.append(dist.irecv(buf, recv_from, group=g))
    for op in ops:
        op.wait()
    if buf is None:
        return None
    head = bytes(buf[: name_len + rec_len].numpy())
    try:
        name = head[:name_len].decode("ascii")
    except UnicodeDecodeError:
        raise FormatError(f"buddy rank {recv_from} sent a parcel whose record name is not ASCII") from None
    return Parcel(step, name, head[name_len:], buf[name_len + rec_len :])


# -- saving: the copies a node keeps for its source ------------------------------------------------
class Buddy:
    """This rank's side of buddy copies (``CheckpointManager(..., buddy=True)``): sending its parts
    to its partner and keeping its source's, on a thread of its own; at restore, finding the steps
    node copies can restore and fetching this rank's part from its holder."""

    def __init__(self, store: Store, rank: int, world_size: int, link: Link | None,
                 retention: Retention | None, nice: int = background.DEFAULT_NICE) -> None:
        self.store = store  # this node's tier 0
        self.rank = rank
        self.world_size = world_size
        self.link = link
        self.retention = retention
        self._pool = background.pool("tierio-ckpt-buddy", nice) if link is not None else None
        self._retired: set[int] = set()

    @staticmethod
    def setup(store: Store, rank: int, world_size: int, group: Any, node: str, bandwidth: float | None,
              timeout: float, retention: Retention | None, nice: int = background.DEFAULT_NICE) -> Buddy:
        """Pair the nodes and make the buddy group: in the caller's thread, on every rank (one
        all_gather_object over ``group``, then ``new_group`` when there is more than one node)."""
        import torch.distributed as dist

        if world_size == 1:
            log.info("buddy copies are off: one rank, one node, so there is no partner node")
            return Buddy(store, rank, world_size, None, retention)
        if group is None:
            raise ConfigError("buddy copies travel over torch.distributed: initialise a process group first "
                              "(torchrun, dist.init_process_group)")
        if [dist.get_global_rank(group, r) for r in range(world_size)] != list(range(dist.get_world_size())):
            # the buddy group is made over the whole job, and its ranks are the manager's ranks
            raise ConfigError("buddy copies need the manager on the whole job's process group (the default one), "
                              "not a subgroup")
        names: list[Any] = [None] * world_size
        dist.all_gather_object(names, node, group=group)
        pairing = pair(names, rank)
        if not pairing.active:
            log.info("buddy copies are off: all %d ranks run on one node (%s), so there is no partner node", world_size, node)
            return Buddy(store, rank, world_size, None, retention)
        buddy_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        limiter = TokenBucket(bandwidth, burst=max(1 << 20, bandwidth / 4)) if bandwidth else None
        log.info("buddy copies: rank %d sends to rank %d and keeps rank %d's (node %s) under %s/%s/",
                 rank, pairing.partner, pairing.source, pairing.source_node, store.url, BUDDY_DIR)
        return Buddy(store, rank, world_size, Link(buddy_group, pairing, limiter), retention, nice)

    @property
    def active(self) -> bool:
        return self.link is not None

    def send(self, step: int, record_name: str | None, done: Future) -> None:
        """Send this rank's part of ``step`` (``record_name`` None: the save failed; an empty header
        goes, so the partner does not wait) and keep the source's, in the background; ``done``
        gets the step of the copy kept (None: none came), or the failure."""
        if self._pool is None:
            done.set_result(None)
            return

        def run() -> None:
            try:
                done.set_result(self._exchange(step, record_name))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through ``done``
                log.warning("rank %d: buddy exchange of step %d failed: %s", self.rank, step, exc)
                done.set_exception(exc)
        try:
            self._pool.submit(run)
        except RuntimeError:  # closed: a save on a closed manager is refused, and exchanges nothing
            done.set_result(None)

    def _exchange(self, step: int, record_name: str | None) -> int | None:
        link = self.link
        assert link is not None and link.pairing.source is not None and link.pairing.partner is not None
        out = None
        if record_name is not None:
            try:
                out = read_parcel(self.store, step, step_key(step, record_name), step_key(step, shard_name(self.rank)))
            except TierioError as exc:
                log.warning("rank %d: no buddy copy of step %d sent: %s", self.rank, step, exc)
        got = transfer(link, [(link.pairing.partner, out)], link.pairing.source, parcel_room(self.store))
        if got is None:
            return None
        base = held_dir(link.pairing.source_node, got.step)
        label = f"the buddy copy of rank {link.pairing.source}'s step {got.step} from node {link.pairing.source_node}"
        entry = check_parcel(got, link.pairing.source, self.world_size, label)
        store_parcel(self.store, base, got, entry)
        self._prune(link.pairing.source_node, got.step)
        return got.step

    def _prune(self, node: str, newest: int) -> None:
        """Retention on the copies kept for ``node``: the tier's policy, as for its own steps."""
        prefix = f"{BUDDY_DIR}/{node}/"
        steps = {s for k in self.store.list(prefix) if (s := parse_step_dir(k[len(prefix):].split("/", 1)[0])) is not None}
        now = time.time()
        held = {s: now for s in steps}
        for s in sorted(steps):
            if s != newest and not wanted(held, self.retention, s, now, now):
                self.store.delete_prefix(f"{prefix}{step_dir(s)}/")

    def retire_after(self, after: int, saved: set[int]) -> None:
        """The rollback rule (``ckpt.steps.lineage``) for kept copies: after a restore of ``after``, the
        copies of later steps belong to the abandoned branch (but those of ``saved``, the new
        branch's). Once per restore; the node's leader calls it."""
        if after in self._retired:
            return
        prefix = BUDDY_DIR + "/"
        for key in {k.rsplit("/", 1)[0] for k in self.store.list(prefix)}:
            step = parse_step_dir(key.rsplit("/", 1)[-1])
            if step is not None and step > after and step not in saved:
                self.store.delete_prefix(key + "/")
        self._retired.add(after)

    def idle(self) -> None:
        """Wait until no exchange runs (the buddy group is free for the caller's thread)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.link is not None:  # its gloo threads would otherwise live until the interpreter's exit
            release_group(self.link.group)
            self.link = None
