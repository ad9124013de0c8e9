"""The one place that knows how to find model weights inside a tierio checkpoint.

A tierio checkpoint is a directory (or key prefix) ``step_<9 digits>/`` holding ``manifest.json``
and safetensors shard files; a checkpoint root holds several steps and the newest committed one
(the one with a manifest) is used. The manifest is read with the checkpoint reader's strict parser
(format.manifest): the shard files it names are plain names inside the step directory, so a
hostile manifest cannot point a load, or the weight cache, at a file outside the model. The shard
files are then read through their own safetensors headers; this module only names the files and
maps tensor names of the model subtree.
"""

from __future__ import annotations

from collections.abc import Callable

from tierio.errors import FormatError, NotFoundError
from tierio.format.manifest import Manifest, parse_manifest, parse_record
from tierio.format.shard import MANIFEST, parse_step_dir
from tierio.storage.base import check_key

MODEL_PREFIXES = ("model.", "model/")


def checkpoint_dir(keys: list[str]) -> str | None:
    """The key prefix ('' or 'step_000000100/') of the newest committed checkpoint in ``keys``."""
    steps = []
    for k in keys:
        head, sep, tail = k.partition("/")
        step = parse_step_dir(head) if sep and tail == MANIFEST else None
        if step is not None:
            steps.append((step, f"{head}/"))
    if steps:
        return max(steps)[1]
    return "" if MANIFEST in keys else None


def checkpoint_shards(keys: list[str], read: Callable[[str], bytes], where: Callable[[str], str]) -> tuple[str, list[str]]:
    """(step prefix, shard keys) of the newest checkpoint in ``keys``.

    ``read(key)`` returns a key's bytes (bounded by the caller), ``where(key)`` names it in messages.
    FormatError when there is no checkpoint or its manifest is damaged or hostile; NotFoundError
    when a shard it names is not there."""
    prefix = checkpoint_dir(keys)
    if prefix is None:
        raise FormatError("no manifest.json found: not a tierio checkpoint")
    key = prefix + MANIFEST
    w = where(key)
    manifest = parse_manifest(read(key), w, expect_step=parse_step_dir(prefix.rstrip("/")) if prefix else None)
    if refers_to_earlier_steps(manifest, prefix, read, where):
        # its shards hold only what changed since an earlier step: their headers do not describe the model
        raise FormatError(f"{w} is an incremental checkpoint (its unchanged tensors lie in earlier steps' shards); "
                          "restore it with CheckpointManager.restore, or write a whole model directory first with "
                          "`tierio ckpt export`")
    shards = sorted(check_key(prefix + rank.file, w) for rank in manifest.ranks)
    present = set(keys)
    missing = [k for k in shards if k not in present]
    if missing:
        raise NotFoundError(f"{w} names shard(s) {missing[:3]} that are not in the checkpoint; the copy is incomplete")
    return prefix, shards


def refers_to_earlier_steps(manifest: Manifest, prefix: str, read: Callable[[str], bytes],
                            where: Callable[[str], str]) -> bool:
    """An incremental step: the manifest's mark, or a chunk reference in any rank's entry. The mark
    is set from the entries the committer knew; entries kept in records by reference (large jobs)
    are read here, so a rank that reused tensors is seen even when the committing rank did not."""
    if manifest.incremental:
        return True
    for r in manifest.ranks:
        if not r.loaded and r.record is not None:
            key = check_key(prefix + r.record.name, where(prefix + MANIFEST))
            if parse_record(read(key), where(key), manifest.step, manifest.world_size).refs:
                return True
    return False


def model_names(names: list[str]) -> dict[str, str]:
    """Map stored tensor names to the names of the model subtree ('model.w' -> 'w').

    When no name starts with a model prefix the checkpoint holds only the model: names are kept.
    """
    picked = {n: n[len(p) :] for n in names for p in MODEL_PREFIXES if n.startswith(p)}
    return picked if picked else {n: n for n in names}
