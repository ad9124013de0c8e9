"""LocalStore: a directory on node-local NVMe or on a shared-filesystem mount (tiers 2 and 3).

Keys come from manifests and indexes, so they are data: every access resolves a key from a
descriptor of the root one component at a time without following symlinks (io.paths), and
listings skip links, so no key reaches outside the root even when someone planted a link in it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from tierio.errors import FormatError, NotFoundError, os_error
from tierio.io import offload
from tierio.io.buffers import ALIGN, address_of
from tierio.io.durable import atomic_copy, atomic_write, is_temp, temp_name
from tierio.io.engine import ByteRange
from tierio.io.direct import pwrite_all
from tierio.io.locks import hold_write_lock, writer_gone
from tierio.io.ranges import read_into
from tierio.io.limiter import TokenBucket
from tierio.io.pagecache import prefetch, range_resident
from tierio.io.paths import open_beneath, open_dir_beneath
from tierio.io.readpath import RESIDENT, SAMPLE_BYTES, ReadPath, read_path_of
from tierio.io.space import disk_space
from tierio.storage.base import Buffer, ObjectInfo, check_key

_DIRECT = getattr(os, "O_DIRECT", 0)


class LocalStore:
    """Keys are relative paths under ``root``. Writes go through the O_DIRECT engine, atomically."""

    def __init__(self, root: str | Path, *, direct: bool = True, limiter: TokenBucket | None = None, create: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.direct = direct
        self.limiter = limiter
        self.offload = False  # background threads' calls run in the persist process (io.offload.routed)
        self._read_paths: dict[bool, ReadPath] = {}
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, self.root, "creating store directory") from exc
        elif not self.root.is_dir():
            raise NotFoundError(f"store directory {self.root} does not exist; create it or fix the URL")
        self.url = f"file://{self.root}"

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file of ``key`` (checked as a key; use :meth:`open` to also refuse links on the way)."""
        return self.root / check_key(key)

    # -- writes ------------------------------------------------------------------------------
    def _writable(self, key: str) -> Path:
        """Create the key's parent directories, refusing a link or a file in their place."""
        parts = check_key(key).split("/")
        try:
            os.close(open_dir_beneath(self.root, parts[:-1], create=True))
        except OSError as exc:
            raise os_error(exc, self.root / key, "creating the directory of") from exc
        return self.root / key

    def _parent_fd(self, key: str) -> int:
        """A descriptor of the key's directory (made as needed, no link followed). Writes create,
        fsync and rename through it, so a directory swapped for a link after this check cannot
        redirect them outside the root."""
        parts = check_key(key).split("/")
        try:
            return open_dir_beneath(self.root, parts[:-1], create=True)
        except OSError as exc:
            raise os_error(exc, self.root / key, "creating the directory of") from exc

    @offload.routed
    def put_buffers(self, key: str, buffers: Sequence[Buffer]) -> int:
        dfd = self._parent_fd(key)
        try:
            return atomic_write(self.root / key, buffers, dir_fd=dfd, direct=self.direct, limiter=self.limiter).bytes
        finally:
            os.close(dfd)

    @offload.routed
    def put_file(self, key: str, path: str | Path) -> int:
        dfd = self._parent_fd(key)
        try:
            return atomic_copy(path, self.root / key, dir_fd=dfd, direct=self.direct, limiter=self.limiter).bytes
        finally:
            os.close(dfd)

    @offload.routed
    def create_exclusive(self, key: str, data: bytes) -> bool:
        # The bytes go to a temp file first and are linked to ``key`` whole: link() fails if the
        # name exists, so there is one winner, and a writer killed part-way leaves a temp file
        # (removed by cleanup), never an empty or torn ``key`` that the next writer must wait out.
        final = self._writable(key)
        parts = key.split("/")
        dfd = open_dir_beneath(self.root, parts[:-1], create=True)
        tmp = temp_name(final).name
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644, dir_fd=dfd)
            try:
                hold_write_lock(fd)
                pwrite_all(fd, memoryview(data), 0, final)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False
            os.fsync(dfd)
            return True
        except OSError as exc:
            raise os_error(exc, final, "creating") from exc
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            os.close(dfd)

    # -- reads -------------------------------------------------------------------------------
    def open(self, key: str, *, direct: bool = False) -> tuple[int, bool]:
        """A read descriptor of ``key`` (a regular file reached without links); (fd, is_direct)."""
        try:
            if direct and _DIRECT:
                try:
                    return open_beneath(self.root, key, os.O_RDONLY | _DIRECT), True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            return open_beneath(self.root, key, os.O_RDONLY), False
        except NotFoundError:
            raise NotFoundError(f"{self.root / key} does not exist (key {key!r} in {self.url})") from None
        except OSError as exc:
            raise os_error(exc, self.root / key, "opening") from exc

    def read_path(self, *, bounced: bool = False) -> ReadPath:
        """How large reads of this directory's file system go, O_DIRECT or buffered (io.readpath);
        ``bounced``: into destinations O_DIRECT cannot land in."""
        if bounced not in self._read_paths:
            self._read_paths[bounced] = read_path_of(self.root, bounced=bounced)
        return self._read_paths[bounced]

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """Large reads take the read way measured for this filesystem (io.readpath), and bytes
        already in the page cache are copied from there (buffered) rather than read again. A
        destination O_DIRECT cannot land in (its address and ``offset`` differ modulo 4 KiB: most
        tensors restored in place) has its own measured way: O_DIRECT would bounce and copy it."""
        n = memoryview(buf).nbytes
        parts = offload.shared_parts([buf]) if self.offload else None
        if parts is not None:  # into staging memory: the persist process reads (io.offload)
            got = offload.read_into(str(self.root), self.direct, key, offset, parts[0])
            if got is not None:
                return got
        if not self.direct or n < SAMPLE_BYTES:
            return self._read(key, offset, buf, direct=self.direct)
        fd, _ = self.open(key)
        try:
            if range_resident(fd, offset, n) >= RESIDENT:
                read_into(self.root / key, offset, buf, direct=False, fd=fd)
                return len(buf)
        finally:
            os.close(fd)
        way = self.read_path(bounced=(address_of(memoryview(buf)) - offset) % ALIGN != 0)
        want = way.direct()
        t0 = time.perf_counter()
        direct = self._read(key, offset, buf, direct=want)
        if want and not direct:
            way.settle("buffered")  # the filesystem refuses O_DIRECT (tmpfs): nothing to measure
        else:
            way.record(direct, n, time.perf_counter() - t0)  # cold bytes: a fair sample
        return len(buf)

    def prefetch(self, key: str, ranges: Sequence[ByteRange]) -> None:
        """Start reading ``ranges`` of ``key`` into the page cache, all of them at once, without
        waiting (POSIX_FADV_WILLNEED). For reads that copy their bytes once whichever way they go
        (destinations O_DIRECT would bounce): the kernel then has the whole ranges queued, where
        buffered reads ask for one readahead window at a time and bounced O_DIRECT reads for a few
        windows, and ``read_into`` finds the bytes resident and copies them from the page cache."""
        if not ranges:
            return
        fd, _ = self.open(key)
        try:
            for r in ranges:
                prefetch(fd, r.start, r.end - r.start)
        finally:
            os.close(fd)

    def _read(self, key: str, offset: int, buf: memoryview, *, direct: bool) -> bool:
        """Read with O_DIRECT when asked and possible; whether it was."""
        fd, is_direct = self.open(key, direct=direct)
        try:
            read_into(self.root / key, offset, buf, direct=is_direct, fd=fd)
        finally:
            os.close(fd)
        return is_direct

    @offload.routed
    def get_file(self, key: str, path: str | Path) -> int:
        fd, _ = self.open(key, direct=self.direct)
        try:
            return atomic_copy(self.root / key, path, direct=self.direct, src_fd=fd).bytes
        finally:
            os.close(fd)

    def _walk_base(self, prefix: str) -> Path | None:
        """The directory holding every key under ``prefix``, reached without links; None if absent."""
        if "/" not in prefix:
            return self.root
        sub = prefix.rsplit("/", 1)[0]
        try:
            os.close(open_dir_beneath(self.root, check_key(sub).split("/")))
        except (NotFoundError, FormatError, OSError):
            return None
        return self.root / sub

    @offload.routed
    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``: regular files only (links and temp files are not keys)."""
        return sorted(self.list_sizes(prefix))

    @offload.routed
    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``list`` with each key's size, from the same walk."""
        base = self._walk_base(prefix)
        if base is None:
            return {}
        out: dict[str, int] = {}
        for dirpath, dirnames, filenames in os.walk(base):  # does not descend into linked directories
            dirnames[:] = [d for d in dirnames if not is_temp(d)]
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if is_temp(name):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while we walked
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    out[key] = st.st_size
        return out

    @offload.routed
    def stat(self, key: str) -> ObjectInfo:
        fd, _ = self.open(key)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    @offload.routed
    def exists(self, key: str) -> bool:
        """True for a regular file reached without links (a planted link is not a key)."""
        try:
            os.close(self.open(key)[0])
        except (NotFoundError, FormatError):
            return False
        return True

    # -- deletes -----------------------------------------------------------------------------
    @offload.routed
    def delete(self, key: str) -> None:
        parts = check_key(key).split("/")
        try:
            dfd = open_dir_beneath(self.root, parts[:-1])
        except (NotFoundError, FormatError):
            return  # no such directory (or a link where it should be): nothing of ours to delete
        try:
            os.unlink(parts[-1], dir_fd=dfd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, self.root / key, "deleting") from exc
        finally:
            os.close(dfd)
        self._prune(parts[:-1])

    def _prune(self, parts: list[str]) -> None:
        """Drop directories left empty, up to the root, so deleted checkpoints leave no husks.
        Each is removed in its parent's descriptor (reached without links): a directory swapped
        for a link meanwhile is never climbed out of."""
        for i in range(len(parts), 0, -1):
            try:
                dfd = open_dir_beneath(self.root, parts[: i - 1])
            except (NotFoundError, FormatError, OSError):
                return
            try:
                os.rmdir(parts[i - 1], dir_fd=dfd)  # a link or a non-empty directory: refused
            except OSError:
                return
            finally:
                os.close(dfd)

    @offload.routed
    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        self._remove_temps(prefix, older_than=0.0, force=True)
        if prefix.endswith("/"):
            self._prune(check_key(prefix.rstrip("/")).split("/"))
        return len(keys)

    @offload.routed
    def cleanup(self, prefix: str = "", older_than: float = 0.0) -> int:
        return self._remove_temps(prefix, older_than=older_than, force=False)

    def _remove_temps(self, prefix: str, *, older_than: float, force: bool) -> int:
        """Unlink temp files under ``prefix`` untouched for ``older_than`` s whose writer is gone.

        A writer holds a lock on its temp file (io.direct.FileWriter) until it renames it into
        place, so a temp file whose lock can be taken belongs to a process that died. ``force``
        skips the lock test (the caller is deleting the whole prefix)."""
        base = self._walk_base(prefix)
        if base is None:
            return 0
        now = time.time()
        removed = 0
        top = os.path.relpath(base, self.root)
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # fwalk descends through directory descriptors and enters no link (it checks each
            # directory it opens is the one it listed), and every test and unlink is made in the
            # descriptor of the directory listed: nothing outside the root is ever touched.
            for dirpath, _, filenames, dfd in os.fwalk(top, dir_fd=rfd):
                for name in filenames:
                    rel = os.path.normpath(os.path.join(dirpath, name)).replace(os.sep, "/")
                    if not is_temp(name) or not rel.startswith(prefix):
                        continue
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= older_than and (
                                force or writer_gone(name, dir_fd=dfd)):
                            os.unlink(name, dir_fd=dfd)
                            removed += 1
                    except FileNotFoundError:
                        continue
        finally:
            os.close(rfd)
        return removed

    @offload.routed
    def capacity(self) -> tuple[int, int] | None:
        return disk_space(self.root)

    def close(self) -> None:
        pass

    @offload.routed
    def read_small(self, key: str, limit: int) -> bytes:
        """The whole of a small object in one open and read (no stat before it that a replacement
        could outdate); an object larger than ``limit`` is a FormatError."""
        fd, _ = self.open(key)
        try:
            data = os.pread(fd, limit + 1, 0)
        except OSError as exc:
            raise os_error(exc, self.root / key, "reading") from exc
        finally:
            os.close(fd)
        if len(data) > limit:
            raise FormatError(f"{self.root / key} is larger than {limit} bytes; it is corrupt or hostile")
        return data
