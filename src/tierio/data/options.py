"""The options of data's entry points: how shards are written, streamed and loaded.

Each is a ``tierio.options.Options``: an entry point takes ``options=`` plus keyword overrides,
sizes are ``*_bytes`` (an int or text such as "64MiB"), and the old keyword names still work for
one release through ``ALIASES``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierio.data.columns import DEFAULT_WINDOW
from tierio.data.shardinfo import Container
from tierio.options import Options

DEFAULT_SHARD_SIZE = 64 << 20


@dataclass(frozen=True)
class ShardOptions(Options):
    """How a ShardWriter cuts and stores shards.

    shard_bytes: a shard is cut once it holds this many bytes (large sequential objects keep
        object stores at full speed).
    format: "columns" (the compact container) or "tar" (the WebDataset layout).
    window_bytes: bytes per checksum window of a columns shard (a power of two, 64 KiB to 1 GiB).
    in_flight: finished shards stored in the background at once while the next fills.
    """

    ALIASES: ClassVar[dict[str, str]] = {"shard_size": "shard_bytes", "window": "window_bytes"}

    shard_bytes: int | str = DEFAULT_SHARD_SIZE
    format: Container = "columns"
    window_bytes: int | str = DEFAULT_WINDOW
    in_flight: int = 2


@dataclass(frozen=True)
class StreamingOptions(Options):
    """How a StreamingDataset orders, caches and hands out samples (see StreamingDataset)."""

    ALIASES: ClassVar[dict[str, str]] = {"cache_limit": "cache_limit_bytes"}

    cache_dir: str | Path | None = None
    cache_limit_bytes: int | str = "64GiB"
    shuffle: bool = True
    seed: int = 0
    shuffle_buffer: int = 4096
    rank: int | None = None
    world_size: int | None = None
    batch_size: int = 1
    prefetch: int = 2
    transform: Callable[[dict[str, Any]], Any] | None = None
    wait_timeout: float = 60.0
    max_open_shards: int = 4
    copy: bool = True


@dataclass(frozen=True)
class LoaderOptions(Options):
    """The knobs of ``loader_settings``; ``None`` means "from this machine" (see tierio.data.loader)."""

    accelerators: int | None = None
    cores: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int = 4
    persistent_workers: bool = True
    drop_last: bool = True


@dataclass(frozen=True)
class RayBuildOptions(Options):
    """How ``tierio.data.raybuild.build_on_ray`` prepares a corpus on Ray.

    address: a Ray cluster ("ray://host:10001", "auto"); None starts a local Ray of ``workers`` CPUs
        (or uses the one this process is already connected to).
    workers: parts built at once (one CPU each).
    retries: times Ray runs a part's task again after its worker died.
    key, tokenizer, text_key, column, text_column, vocab_size, append_eos: as in `tierio data build`
        (each part is one input built with them); ``vocab_size`` (or the tokenizer's) gives every
        part the same token dtype.
    scratch_dir: where a task builds its part before publishing it (default: the system's temp dir).
    progress: called about once a second with a ``BuildProgress`` (parts, documents, tokens, rate).
    """

    address: str | None = None
    workers: int = 2
    retries: int = 3
    key: str = "tokens"
    tokenizer: str | Path | None = None
    text_key: str = "text"
    column: str | None = None
    text_column: str | None = None
    vocab_size: int | None = None
    append_eos: int | None = None
    scratch_dir: str | None = None
    progress: Callable[[Any], None] | None = None


__all__ = ["DEFAULT_SHARD_SIZE", "LoaderOptions", "RayBuildOptions", "ShardOptions", "StreamingOptions"]
