"""References between the steps of an incremental checkpoint (``ckpt.saving.incremental``), counted.

A step's chunks may lie in a shard of an earlier step (``step_<n>/rank_<r>.safetensors``). Deleting
a step (retention, ``gc``, ``delete_step``, a rollback) removes its manifest and every file of its
directory but those another committed step on the *same* tier still refers to; a directory left
holding only such files is no checkpoint (no manifest) and goes once nothing refers to it. Each
tier is counted from the manifests committed there (a node-local tier: from the shared tier's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import logging

from tierio.errors import DanglingReferenceError, FormatError, IntegrityError, TierioError
from tierio.format.manifest import Manifest, RankEntry, ref_step
from tierio.storage.base import Store

from tierio.ckpt.steps.commit import read_record
from tierio.ckpt.steps.reader import committed_in, read_manifest

log = logging.getLogger("tierio.ckpt")


def entry_refs(man: Manifest, entries: Iterable[RankEntry]) -> set[str]:
    """The keys of earlier steps' files that ``entries`` (of ``man``) refer to."""
    return {f for e in entries for f in e.refs}


def manifest_refs(store: Store, man: Manifest) -> set[str]:
    """The files of earlier steps ``man`` (read from ``store``) refers to; records by reference are
    read from ``store`` too."""
    entries = [e if e.loaded else read_record(store, man.step, man.world_size, e.record)  # type: ignore[arg-type]
               for e in man.ranks]
    return entry_refs(man, entries)


def referenced(store: Store, steps: Sequence[int], manifests_on: Store | None = None) -> set[str]:
    """Every file key the committed ``steps`` refer to (their manifests on ``manifests_on``, default
    ``store``). A store that cannot be read raises (StorageError): nothing may be deleted on a guess.
    A damaged manifest (or record) is skipped with a warning: that copy restores nothing, so it
    keeps nothing either, as before incremental checkpoints."""
    src = manifests_on or store
    out: set[str] = set()
    for s in steps:
        try:
            out |= manifest_refs(src, read_manifest(src, s))
        except (FormatError, IntegrityError) as exc:
            log.warning("step %d on %s is damaged; the files it may refer to are not kept for it: %s", s, src.url, exc)
    return out


def reference_only(store: Store, dirs: dict[int, list[str]]) -> set[int]:
    """The manifest-less step directories of a ``step_dirs`` listing that hold only shards committed
    steps refer to (what deleting a referenced step leaves): not debris, not a partial checkpoint.
    Empty when a manifest cannot be read (the directories are then reported as they are)."""
    committed = committed_in(dirs)
    try:
        refs = referenced(store, committed)
    except TierioError:
        return set()
    return {s for s, keys in dirs.items() if s not in committed and keys and set(keys) <= refs}


_ABSENT = ("does not exist", "not found", "no such", "missing")  # how stores word a missing key


def no_good_copy(step: int, file: str, tensors: Sequence[str], problems: list[str]) -> IntegrityError:
    """The error of a restore that found no good copy of ``file`` on any tier: a dangling reference
    when ``file`` is an earlier step's shard that no tier holds."""
    detail = "; ".join(problems or ["not found"])
    base = ref_step(file)
    if base is not None and all(any(m in p.lower() for m in _ABSENT) for p in problems or ["not found"]):
        names = ", ".join(repr(t) for t in tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
        return DanglingReferenceError(
            f"dangling reference: step {step} tensor {names} refers to {file} (step {base}), which no tier holds: "
            f"{detail}; restore another step (the referenced step was deleted outside tierio)",
            step, tensors[0] if tensors else "", file)
    return IntegrityError(f"no good copy of {file} of step {step} on any tier: {detail}")


__all__ = ["entry_refs", "manifest_refs", "no_good_copy", "reference_only", "referenced"]
