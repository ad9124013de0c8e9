"""DCP's ``checkpoint_id`` and a writer's or reader's target, as tierio tiers and steps."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Union

from tierio.errors import ConfigError
from tierio.format.shard import parse_step_dir
from tierio.storage.base import Store

from tierio.ckpt.tier import Tier


_STEP_ID = re.compile(r"(?:step_)?(\d{1,9})")


def step_of(checkpoint_id: Any) -> int:
    """A DCP checkpoint id for tierio: a step number (100, "100" or "step_000000100")."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    m = _STEP_ID.fullmatch(os.fspath(checkpoint_id)) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if m is None:
        raise ConfigError(f"checkpoint_id {checkpoint_id!r} is not a tierio step: pass a step number such as 100")
    return int(m.group(1))


Place = Union[str, "os.PathLike[str]", Store, Tier]
TIERS_TAKEN = ("a CheckpointManager, a path or URL (what FileSystemWriter takes), a Store or a Tier, or a list "
               "of them, fastest first")


def place_of(checkpoint_id: Any) -> tuple[str | None, int | None]:
    """DCP's ``checkpoint_id`` as (tier, step): a step number (100, "100", "step_000000100") names a
    step; a path or URL names a tier (``/ckpt/run1``) or a step in one (``/ckpt/run1/step_000000100``)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return None, step_of(checkpoint_id)
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise ConfigError(f"checkpoint_id {checkpoint_id!r} is neither a step number nor a path or URL")
    text = os.fspath(checkpoint_id)
    if _STEP_ID.fullmatch(text):
        return None, step_of(text)
    head, _, tail = text.rstrip("/").rpartition("/")
    step = parse_step_dir(tail)
    if step is not None and head:
        return head, step
    return text, None


def is_checkpoint_id(checkpoint_id: Any) -> bool:
    """Whether DCP's ``checkpoint_id`` is one ``place_of`` reads."""
    try:
        place_of(checkpoint_id)
    except ConfigError:
        return False
    return True


def tier_list(target: Any, who: str) -> list[Place]:
    """What a writer or reader was given in place of a manager, checked: a list of tiers."""
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    bad = [x for x in items if not isinstance(x, (str, os.PathLike, Store, Tier))]
    if not items or bad:
        got = bad[0] if bad else target
        raise ConfigError(f"{who} takes {TIERS_TAKEN}; got {type(got).__name__} {got!r}")
    return items


def url_of(place: Any) -> str:
    """A tier's location as one name to compare: its URL without query options (as ``where`` names
    a store), a local path as ``LocalStore`` names it (``file://`` and the absolute path)."""
    if isinstance(place, Tier):
        place = place.url
    text = place.url if isinstance(place, Store) else os.fspath(place)
    if "://" not in text:
        text = f"file://{Path(text).expanduser().absolute()}"
    return text.split("?", 1)[0].rstrip("/")
