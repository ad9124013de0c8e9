"""Which run wrote a checkpoint, and the rollback rule.

Every manifest records the run that wrote it and the step that run resumed from
(``extra["tierio.run"]``, ``extra["tierio.resumed_from"]``; null for a fresh start), and why it was
saved when that was not the training loop's schedule (``extra["tierio.reason"]``, e.g. an emergency
save on SIGTERM; absent otherwise).

**Rollback rule (supersede).** Restoring step S and saving again starts a new branch: the steps
after S that the old branch committed are abandoned. The first save after ``restore()`` retires
them on every tier before it commits: first every manifest of a step after S (newest first, so they
stop being checkpoints at once), then their directories. The step being saved keeps its directory
(its shards are being rewritten there) and loses only the old manifest. Without this, the old
branch's step N on a slower tier would shadow the new step N (promotion found "a step N" there and
skipped it) and retention would then delete the only copy of the new one. Promotion therefore
treats a copy on a slower tier as already there only when its manifest bytes are the source's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tierio.errors import FormatError, NotFoundError
from tierio.format.manifest import Manifest
from tierio.format.shard import manifest_key
from tierio.io.checksum import xxh3
from tierio.io.untrusted import Fields
from tierio.storage.base import Store

from tierio.ckpt.steps.gc import delete_step
from tierio.ckpt.steps.commit import read_manifest_bytes
from tierio.ckpt.steps.reader import committed_steps, step_dirs

log = logging.getLogger("tierio.ckpt")

RUN_FIELD = "tierio.run"
RESUMED_FIELD = "tierio.resumed_from"
REASON_FIELD = "tierio.reason"


@dataclass(frozen=True)
class Lineage:
    """The run saving a checkpoint, the step it resumed from (None: a fresh start) and why this
    step was saved (None: an ordinary save)."""

    run: str
    resumed_from: int | None = None
    reason: str | None = None

    @property
    def token(self) -> str:
        """A short name of the run. It names the manifest fragments, so a fragment another run left
        in a step directory is never merged into this run's manifest. (Not the branch: ranks whose
        restores fell back to different steps must still find each other's fragments.)"""
        return xxh3(self.run.encode())[:8]

    def extra(self) -> dict:
        out: dict = {RUN_FIELD: self.run, RESUMED_FIELD: self.resumed_from}
        if self.reason is not None:
            out[REASON_FIELD] = self.reason
        return out

    @staticmethod
    def of(man: Manifest, where: str) -> Lineage | None:
        """The lineage a manifest records (None for manifests written before it was recorded)."""
        return Lineage.parse(man.extra, where)

    @staticmethod
    def parse(extra: dict, where: str) -> Lineage | None:
        """The lineage in a manifest's or a record's ``extra`` (None when it records none)."""
        f = Fields(extra, f"{where}: extra")
        run = f.str(RUN_FIELD, 128, default=None)
        if run is None:
            return None
        return Lineage(run, f.int(RESUMED_FIELD, 0, 10**9 - 1, default=None), f.str(REASON_FIELD, 128, default=None))


@dataclass
class Rollback:
    """What a save owes after ``restore(after)``: retiring the abandoned branch on every tier."""

    after: int
    first: int | None = None  # the first step saved after the restore (keeps its directory)
    manifests_done: set[str] = field(default_factory=set)  # tier urls
    dirs_done: set[str] = field(default_factory=set)

    def retire_manifests(self, store: Store) -> list[int]:
        """Delete the manifest of every committed step after ``after``, newest first."""
        if store.url in self.manifests_done:
            return []
        steps = sorted((s for s in committed_steps(store) if s > self.after), reverse=True)
        for s in steps:
            store.delete(manifest_key(s))
        if steps:
            log.warning("rollback to step %d: retired the abandoned steps %s on %s", self.after, sorted(steps), store.url)
        self.manifests_done.add(store.url)
        return steps

    def retire_dirs(self, store: Store) -> list[int]:
        """Delete what is left of the abandoned steps (after their manifests) on ``store``."""
        self.retire_manifests(store)
        if store.url in self.dirs_done:
            return []
        steps = sorted(s for s in step_dirs(store) if s > self.after and s != self.first)
        for s in steps:
            delete_step(store, s)
        self.dirs_done.add(store.url)
        return steps


def manifest_on(store: Store, step: int) -> bytes | None:
    """The manifest bytes of ``step`` on ``store``: None when there is none, b"" when one is there
    but cannot be read as one (oversized, not a regular file). An unreachable store raises."""
    try:
        return read_manifest_bytes(store, step)
    except NotFoundError:
        return None
    except FormatError:
        return b""


def same_copy(store: Store, step: int, raw: bytes) -> bool:
    """Does ``store`` hold exactly this checkpoint of ``step`` (the same manifest bytes)?"""
    return manifest_on(store, step) == raw
