"""Retention policies: small composable objects that say which committed steps a tier keeps.

    KeepLast(3)                       the 3 newest steps
    KeepEvery(1000)                   steps divisible by 1000
    KeepWithin(48 * 3600)             steps committed in the last 48 hours
    KeepAll()                         everything, and the tier is immutable (never deleted from)
    KeepLast(3) | KeepEvery(1000)     keep what either keeps
    KeepLast(10) & KeepEvery(100)     keep what both keep

``gc_plan`` turns per-tier policies into deletions while enforcing the safety rules: never
delete the newest checkpoint, never delete the only copy of a step that some tier still wants (a
promotion may be pending), and keep at least ``min_keep`` distinct valid checkpoints across all
tiers. ``ckpt.steps.gc.collect`` carries the plan out.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierio.errors import ConfigError


@dataclass(frozen=True)
class StepInfo:
    step: int
    timestamp: float  # commit time, seconds since the epoch


class Retention:
    """Base class: ``keep(steps, now)`` returns the steps to keep among ``steps``."""

    immutable = False

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __or__(self, other: Retention) -> Retention:
        return AnyOf((self, other))

    def __and__(self, other: Retention) -> Retention:
        return AllOf((self, other))


@dataclass(frozen=True)
class KeepLast(Retention):
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ConfigError(f"KeepLast needs n >= 0, got {self.n}")

    def keep(self, steps, now):
        return {s.step for s in sorted(steps, key=lambda s: s.step)[-self.n:]} if self.n else set()

    def __str__(self) -> str:
        return f"last:{self.n}"


@dataclass(frozen=True)
class KeepEvery(Retention):
    k: int

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ConfigError(f"KeepEvery needs k >= 1, got {self.k}")

    def keep(self, steps, now):
        return {s.step for s in steps if s.step % self.k == 0}

    def __str__(self) -> str:
        return f"every:{self.k}"


@dataclass(frozen=True)
class KeepWithin(Retention):
    seconds: float

    def keep(self, steps, now):
        return {s.step for s in steps if now - s.timestamp <= self.seconds}

    def __str__(self) -> str:
        return f"within:{self.seconds:g}s"


@dataclass(frozen=True)
class KeepAll(Retention):
    immutable = True

    def keep(self, steps, now):
        return {s.step for s in steps}

    def __str__(self) -> str:
        return "all"


@dataclass(frozen=True)
class AnyOf(Retention):
    policies: tuple[Retention, ...]

    @property
    def immutable(self) -> bool:  # type: ignore[override]
        return any(p.immutable for p in self.policies)

    def keep(self, steps, now):
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps, now)
        return out

    def __str__(self) -> str:
        return "+".join(str(p) for p in self.policies)


@dataclass(frozen=True)
class AllOf(Retention):
    policies: tuple[Retention, ...]

    @property
    def immutable(self) -> bool:  # type: ignore[override]
        return all(p.immutable for p in self.policies)

    def keep(self, steps, now):
        sets = [p.keep(steps, now) for p in self.policies]
        return set.intersection(*sets) if sets else set()

    def __str__(self) -> str:
        return "&".join(str(p) for p in self.policies)


_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_retention(text: str) -> Retention:
    """'last:3', 'every:1000', 'within:48h', 'all', combined with '+' (any) or '&' (all)."""
    text = text.strip()
    if "+" in text:
        return AnyOf(tuple(parse_retention(t) for t in text.split("+")))
    if "&" in text:
        return AllOf(tuple(parse_retention(t) for t in text.split("&")))
    m = re.fullmatch(r"(last|every|within|all)(?::(\S+))?", text)
    if not m:
        raise ConfigError(f"cannot read retention {text!r}: use last:N, every:K, within:48h, all, joined by + or &")
    kind, arg = m.groups()
    try:
        if kind == "all":
            return KeepAll()
        if arg is None:
            raise ValueError
        if kind == "last":
            return KeepLast(int(arg))
        if kind == "every":
            return KeepEvery(int(arg))
        d = re.fullmatch(r"([0-9.]+)([smhdw]?)", arg)
        if not d:
            raise ValueError
        return KeepWithin(float(d.group(1)) * _DURATION[d.group(2) or "s"])
    except ValueError:
        raise ConfigError(f"cannot read retention {text!r}: {kind} needs a number, e.g. last:3, every:1000, within:48h") from None


@dataclass
class GcPlan:
    delete: list[tuple[int, int]] = field(default_factory=list)  # (tier index, step)
    warnings: list[str] = field(default_factory=list)


def wanted(held: dict[int, float], policy: Retention | None, step: int, ts: float, now: float | None = None) -> bool:
    """Would a tier holding ``held`` with ``policy`` keep ``step`` if it had a copy?"""
    if policy is None or policy.immutable:
        return True
    infos = [StepInfo(s, t) for s, t in held.items() if s != step] + [StepInfo(step, ts)]
    return step in policy.keep(infos, time.time() if now is None else now)


def gc_plan(
    tiers: Sequence[dict[int, float]],
    policies: Sequence[Retention | None],
    *,
    min_keep: int = 3,
    protected: set[int] | frozenset[int] = frozenset(),
    names: Sequence[str] | None = None,
    now: float | None = None,
) -> GcPlan:
    """Decide deletions. ``tiers[i]`` maps the committed steps on tier i to their commit time;
    ``policies[i]`` is that tier's retention (None keeps everything). ``protected`` steps (in
    flight, promotion pending) are never deleted anywhere."""
    now = time.time() if now is None else now
    names = list(names or [f"tier {i}" for i in range(len(tiers))])
    plan = GcPlan()
    keep: list[set[int]] = []
    for i, held in enumerate(tiers):
        p = policies[i]
        infos = [StepInfo(s, t) for s, t in held.items()]
        keep.append(set(held) if p is None or p.immutable else p.keep(infos, now) | (set(held) & set(protected)))

    def wanted_by_tier(j: int, step: int, ts: float) -> bool:
        return wanted(tiers[j], policies[j], step, ts, now)

    doomed: set[tuple[int, int]] = set()
    for i, held in enumerate(tiers):
        for step in sorted(set(held) - keep[i]):
            others = [j for j in range(len(tiers)) if j != i]
            safe_elsewhere = any(step in tiers[j] and step in keep[j] for j in others)
            wanted_elsewhere = any(step not in tiers[j] and wanted_by_tier(j, step, held[step]) for j in others)
            if wanted_elsewhere and not safe_elsewhere:
                continue  # the only copy of a step another tier still expects (promotion pending)
            doomed.add((i, step))
    # Keep at least min_keep distinct steps across all tiers.
    all_steps = set().union(*[set(t) for t in tiers]) if tiers else set()
    surviving = {s for i, t in enumerate(tiers) for s in t if (i, s) not in doomed}
    if len(surviving) < min(min_keep, len(all_steps)):
        for step in sorted(all_steps - surviving, reverse=True):
            if len(surviving) >= min_keep:
                break
            i = min(i for i, t in enumerate(tiers) if step in t)
            doomed.discard((i, step))
            surviving.add(step)
            plan.warnings.append(
                f"retention policies would leave fewer than {min_keep} valid checkpoints; keeping step {step} on {names[i]}"
            )
    # The newest checkpoint always survives somewhere, whatever the policies and min_keep say.
    if all_steps:
        newest = max(all_steps)
        holders = [i for i, t in enumerate(tiers) if newest in t]
        if all((i, newest) in doomed for i in holders):
            doomed.discard((holders[0], newest))
            plan.warnings.append(f"retention policies would delete the newest checkpoint, step {newest}; "
                                 f"keeping it on {names[holders[0]]}")
    plan.delete = sorted(doomed, key=lambda x: (x[1], x[0]))
    return plan
