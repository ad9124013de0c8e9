"""The byte engine: aligned reusable host buffers, O_DIRECT parallel file I/O, durability,
checksums, a bandwidth limiter and per-operation stats."""

from tierio.io.buffers import ALIGN, BufferPool, HostBuffer, align_down, align_up
from tierio.io.checksum import StreamingChecksum, verify, xxh3
from tierio.io.durable import atomic_copy, atomic_write, fsync_dir, is_temp, write_json_atomic
from tierio.io.direct import DEFAULT_CHUNK, DEFAULT_DEPTH, FileWriter, write_file
from tierio.io.ranges import copy_file, read_file, read_into
from tierio.io.limiter import TokenBucket
from tierio.io.stats import IOStats

__all__ = [
    "ALIGN", "BufferPool", "HostBuffer", "align_down", "align_up",
    "StreamingChecksum", "verify", "xxh3",
    "atomic_copy", "atomic_write", "fsync_dir", "is_temp", "write_json_atomic",
    "DEFAULT_CHUNK", "DEFAULT_DEPTH", "FileWriter", "copy_file", "read_file", "read_into", "write_file",
    "TokenBucket", "IOStats",
]
