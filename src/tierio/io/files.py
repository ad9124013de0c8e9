"""Large aligned file I/O: the names this module held, now in modules named for what they hold.

O_DIRECT writes and file opens are in tierio.io.direct, range reads and copies in tierio.io.ranges,
file locks in tierio.io.locks, ``map_readonly`` in tierio.io.mapping and ``os_error`` in
tierio.errors. Importing them from here keeps working.
"""

from __future__ import annotations

from tierio.errors import os_error
from tierio.io.direct import (
    DEFAULT_CHUNK,
    DEFAULT_DEPTH,
    FileWriter,
    bounce_pool,
    open_file,
    pread_full,
    pwrite_all,
    write_file,
)
from tierio.io.engine import executor
from tierio.io.locks import hold_write_lock, writer_gone
from tierio.io.mapping import map_readonly
from tierio.io.ranges import copy_file, read_file, read_into

__all__ = ["DEFAULT_CHUNK", "DEFAULT_DEPTH", "FileWriter", "bounce_pool", "copy_file", "executor", "hold_write_lock",
           "map_readonly", "open_file", "os_error", "pread_full", "pwrite_all", "read_file", "read_into", "write_file",
           "writer_gone"]
