"""The one shape of what an operation reports: a dataclass whose ``to_dict()`` gives plain JSON
types (what ``--json`` prints and what tests compare). Stats, reports and infos subclass ``Stats``."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import PurePath
from typing import Any


def plain(value: Any) -> Any:
    """``value`` as JSON types: dataclasses as dicts, enums as their values, paths as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        if to_dict is not None and isinstance(value, Stats):
            return to_dict()
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return value


class Stats:
    """Mixin for report dataclasses; subclasses add derived figures by overriding ``to_dict``."""

    def to_dict(self) -> dict[str, Any]:
        assert dataclasses.is_dataclass(self), f"{type(self).__name__} must be a dataclass"
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.repr}
