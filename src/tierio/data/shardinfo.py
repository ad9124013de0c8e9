"""One shard as a dataset manifest lists it: its own module so that the containers (tar, columns)
and the manifest parser can both name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tierio.data.columns import Column

Container = Literal["columns", "tar"]


@dataclass
class ShardInfo:
    """One shard as the manifest lists it. Tar shards name their index file (``index_*``);
    columns shards carry their layout (``columns``) and a checksum per ``window`` bytes."""

    key: str
    size: int
    xxh3: str
    samples: int
    first_sample: int
    index_key: str = ""
    index_size: int = 0
    index_xxh3: str = ""
    columns: tuple[Column, ...] = ()
    window: int = 0
    windows: tuple[str, ...] = ()

    @property
    def container(self) -> Container:
        return "tar" if self.index_key else "columns"

    def to_dict(self) -> dict[str, Any]:
        head = {"key": self.key, "size": self.size, "xxh3": self.xxh3, "samples": self.samples,
                "first_sample": self.first_sample}
        if self.index_key:
            return {**head, "index_key": self.index_key, "index_size": self.index_size, "index_xxh3": self.index_xxh3}
        return {**head, "columns": [c.to_json() for c in self.columns], "window": self.window,
                "windows": list(self.windows)}
