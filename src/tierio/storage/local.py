"""LocalStore: a directory on node-local NVMe or on a shared-filesystem mount (tiers 2 and 3)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tierio.errors import NotFoundError
from tierio.io.durable import atomic_copy, atomic_write, is_temp
from tierio.io.files import os_error, read_into
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Buffer, ObjectInfo, check_key


class LocalStore:
    """Keys are relative paths under ``root``. Writes go through the O_DIRECT engine, atomically."""

    def __init__(self, root: str | Path, *, direct: bool = True, limiter: TokenBucket | None = None, create: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.direct = direct
        self.limiter = limiter
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
        return self.root / check_key(key)

    def put_buffers(self, key: str, buffers: Sequence[Buffer]) -> int:
        return atomic_write(self.path(key), buffers, direct=self.direct, limiter=self.limiter).bytes

    def put_file(self, key: str, path: str | Path) -> int:
        return atomic_copy(path, self.path(key), direct=self.direct, limiter=self.limiter).bytes

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        read_into(self._existing(key), offset, buf, direct=self.direct)
        return len(buf)

    def get_file(self, key: str, path: str | Path) -> int:
        return atomic_copy(self._existing(key), path, direct=self.direct).bytes

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not is_temp(d)]
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if is_temp(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def stat(self, key: str) -> ObjectInfo:
        p = self.path(key)
        try:
            st = p.stat()
        except OSError as exc:
            raise os_error(exc, p, "reading") from exc
        if not p.is_file():
            raise NotFoundError(f"{p} is not a file")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        p = self.path(key)
        try:
            p.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, p, "deleting") from exc
        # Drop directories left empty, up to the root, so deleted checkpoints leave no husks.
        parent = p.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def close(self) -> None:
        pass

    def _existing(self, key: str) -> Path:
        p = self.path(key)
        if not p.is_file():
            raise NotFoundError(f"{p} does not exist (key {key!r} in {self.url})")
        return p
