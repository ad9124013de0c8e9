"""A tier as a restore reads it."""

from __future__ import annotations

from dataclasses import dataclass

from tierio.storage.base import Store


@dataclass(frozen=True)
class Source:
    """A tier a restore may read files from. A node-local tier holds only its node's ranks' files,
    so a file missing there is expected, not a bad copy."""

    store: Store
    node_local: bool = False
