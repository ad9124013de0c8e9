"""The ledger's invariants, stated as checks (read-only): what ``KVCache.check`` and the tests
assert after any sequence of calls. Each slot of a tier is free, in hand (taken by a thread about
to attach it), in limbo (its copy was dropped while still being read) or held by exactly one
copy; every copy is in its tier's LRU and nothing else is; no count is negative; a LEAVING copy
is counted in ``leaving`` of its tier."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from tierio.kv.entries import LOCAL_TIERS, MEMORY_TIERS, Entry, State
from tierio.kv.stats import KVTier


def entry_problems(entries: Mapping[bytes, Entry], lru: Mapping[KVTier, Collection[bytes]],
                   tiers: dict[KVTier, tuple[int, list[int]]]) -> list[str]:
    """Broken invariants of the entries: ``lru`` holds the keys in each tier's LRU, ``tiers`` maps
    each tier present to its slot count and the slots not held by a copy."""
    out: list[str] = [f"{t.value}: a slot listed free twice" for t, (_, free) in tiers.items() if len(set(free)) != len(free)]
    free_sets = {t: (n, set(free)) for t, (n, free) in tiers.items()}
    used: dict[KVTier, dict[int, bytes]] = {t: {} for t in tiers}
    for key, e in entries.items():
        if e.key != key:
            out.append(f"entry {key.hex()} filed under another key")
        if e.pins < 0:
            out.append(f"{key.hex()}: negative pins")
        if not e.has_copies() and not e.pins:
            out.append(f"{key.hex()}: no copy and no pin, still listed")
        for tier in LOCAL_TIERS:
            c = e.copy(tier)
            if c is None:
                if key in lru[tier]:
                    out.append(f"{key.hex()}: in the {tier.value} LRU without a copy there")
                continue
            if tier not in free_sets:
                out.append(f"{key.hex()}: a copy in absent tier {tier.value}")
                continue
            if c.readers < 0:
                out.append(f"{key.hex()}: negative readers in {tier.value}")
            if key not in lru[tier]:
                out.append(f"{key.hex()}: {tier.value} copy missing from its LRU")
            nslots, free = free_sets[tier]
            if not 0 <= c.slot < nslots:
                out.append(f"{key.hex()}: {tier.value} slot {c.slot} out of range")
            if c.slot in free:
                out.append(f"{key.hex()}: {tier.value} slot {c.slot} is both free and in use")
            if c.slot in used[tier]:
                out.append(f"{tier.value} slot {c.slot} held by two blocks")
            used[tier][c.slot] = key
    for tier, (nslots, free) in free_sets.items():
        if len(used[tier]) + len(free) != nslots:
            out.append(f"{tier.value}: {len(used[tier])} used + {len(free)} free != {nslots} slots")
        if len(lru[tier]) != len(used[tier]):
            out.append(f"{tier.value}: LRU lists {len(lru[tier])} blocks, {len(used[tier])} hold slots")
    return out


def leaving_problems(entries: Iterable[Entry], leaving: Mapping[KVTier, int]) -> list[str]:
    """``leaving`` (the ledger's count of LEAVING copies per memory tier) against the entries."""
    entries = list(entries)
    out = []
    for tier in MEMORY_TIERS:
        n = sum(1 for e in entries if (c := e.copy(tier)) is not None and c.state is State.LEAVING)
        if leaving[tier] != n:
            out.append(f"the count of LEAVING {tier.value} copies is off")
    return out


def pinned_and_reading(entries: Iterable[Entry]) -> tuple[int, int]:
    """Blocks pinned, and transfers reading a copy, right now."""
    entries = list(entries)
    return (sum(1 for e in entries if e.pins),
            sum(c.readers for e in entries for t in LOCAL_TIERS if (c := e.copy(t)) is not None))


__all__ = ["entry_problems", "leaving_problems", "pinned_and_reading"]
