"""S3Store: an S3-compatible object store (tier 4), on boto3.

Large objects move as parallel parts: multipart upload with ``concurrency`` parts in flight, and
parallel ranged GETs read straight into the caller's buffer. An object appears under its final key
only when CompleteMultipartUpload (or a single PUT) succeeds, so a failed upload leaves nothing
visible; the upload is aborted so no parts linger (when the endpoint is gone, ``cleanup`` aborts it
later).

Every call ends within its deadline (``S3Options.timeout`` seconds after the endpoint last
answered, see ``storage.deadline``) with a result or a typed error: each request is bounded by the
connect and read timeouts, and is tried again - throttling, 5xx answers, timeouts, connections
dropped mid-body (the rest of the range is asked for again) - only while another whole attempt
still fits. botocore's own retries are off so that nothing retries behind the deadline's back.

An S3Store is not fork-safe (boto3 clients and the part threads do not survive ``fork``): open a
new store in a child process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from tierio.errors import (
    FormatError,
    IntegrityError,
    NotFoundError,
    StorageError,
    os_error,
)
from tierio.io import background
from tierio.io.buffers import ALIGN, HostBuffer, align_up
from tierio.io.durable import fsync_dir, temp_name
from tierio.io.direct import open_file
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Buffer, ObjectInfo, check_key
from tierio.storage.deadline import Deadline, backoff, run_all
from tierio.storage.s3_errors import (
    FAILURES,
    ShortBody,
    Target,
    classify,
    client_error_code,
    field,
    gave_up,
)
from tierio.storage.s3_body import Pace, _safe_key, read_piece, read_some
from tierio.storage.s3_options import S3Options, Upload, _endpoint, _session, s3_options
from tierio.storage.s3_upload import MultipartUploads
from tierio.units import MiB

log = logging.getLogger(__name__)
T = TypeVar("T")
UPLOAD_PAGE = 1000  # multipart uploads asked for per listing page (the S3 maximum)
READ_CHUNK = 1 * MiB  # the most one read of a body asks for; each returns what one socket read got


class S3Store(MultipartUploads):
    """A bucket and a key prefix on an S3 endpoint; see the module docstring for deadlines.

    ``options`` (an S3Options) or its fields as keywords (``part_size=``, ``timeout=``, ...) tune
    the transfer and the deadline."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        options: S3Options | None = None,
        limiter: TokenBucket | None = None,
        **overrides: Any,
    ) -> None:
        if not bucket:
            raise StorageError("an S3 URL needs a bucket: s3://BUCKET/prefix")
        self.options = s3_options(options, overrides)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = _endpoint(endpoint)
        self.part_size = self.options.part_size
        self.concurrency = self.options.concurrency
        self.limiter = limiter
        o = self.options
        self.client = _session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=Config(
                max_pool_connections=self.concurrency * 2,
                retries={"total_max_attempts": 1, "mode": "standard"},  # retried here, within the deadline
                connect_timeout=o.connect_timeout,
                read_timeout=o.read_timeout,
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._pools = background.Pools("tierio-s3", self.concurrency)  # by the caller's priority (io.background)
        self._local = threading.local()
        where = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.url = where + (f"?endpoint={self.endpoint}" if self.endpoint else "")

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # -- helpers -----------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _target(self, what: str, full_key: str | None = None) -> Target:
        where = f"s3://{self.bucket}/{full_key}" if full_key else f"s3://{self.bucket}"
        return Target(what, where, self.endpoint or "default AWS")

    def _deadline(self) -> Deadline:
        return Deadline(self.options.timeout)

    def _attempts(self, t: Target, deadline: Deadline, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` until it succeeds, fails for good, or another try would overrun ``deadline``."""
        tries = 0
        while True:
            deadline.check()
            tries += 1
            try:
                result = attempt()
            except FAILURES as exc:
                failure = classify(exc, t)
                if not failure.transient:
                    raise failure.error from None
                pause = backoff(tries)
                if tries < self.options.max_attempts and not deadline.cancelled \
                        and deadline.allows(pause + self.options.attempt_seconds):
                    log.debug("retrying %s %s after %s", t.what, t.where, failure.reason)
                    time.sleep(pause)
                    continue
                raise gave_up(failure, t, tries, deadline.elapsed(), self.options.timeout) from None
            deadline.progress()
            return result

    def _request(self, t: Target, deadline: Deadline, fn: Callable[..., T], **kw: Any) -> T:
        """One boto3 call on this bucket, retried within ``deadline``; typed errors only."""
        return self._attempts(t, deadline, lambda: fn(Bucket=self.bucket, **kw))

    def _consume(self, n: int) -> None:
        if self.limiter:
            self.limiter.consume(n)

    # -- bucket ------------------------------------------------------------------------------
    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for demos and tests)."""
        try:
            self._request(self._target("creating bucket"), self._deadline(), self.client.create_bucket)
        except StorageError as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
                raise

    # -- writes ------------------------------------------------------------------------------
    def _scratch(self) -> bytearray:
        """This thread's part-sized buffer, allocated (and so faulted in) once and reused.

        Fresh memory for every part would pay a page fault per 4 KiB on each request, which on
        virtual machines costs more than the transfer itself."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) != self.part_size:
            buf = self._local.buf = bytearray(self.part_size)
        return buf

    @staticmethod
    def _body(scratch: bytearray, n: int) -> bytearray | bytes:
        return scratch if n == len(scratch) else bytes(memoryview(scratch)[:n])

    def put_buffers(self, key: str, buffers: Sequence[Buffer]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)

        def part(offset: int, length: int) -> bytearray | bytes:
            out = self._scratch()
            pos = 0
            skip = offset
            for v in views:
                if skip >= len(v):
                    skip -= len(v)
                    continue
                take = min(len(v) - skip, length - pos)
                out[pos : pos + take] = v[skip : skip + take]
                pos += take
                skip = 0
                if pos == length:
                    break
            return self._body(out, length)

        return self._upload(key, total, part)

    def put_file(self, key: str, path: str | Path) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise os_error(exc, path, "uploading") from exc

        def part(offset: int, length: int) -> bytearray | bytes:
            out = self._scratch()
            got = os.preadv(fd, [memoryview(out)[:length]], offset)
            if got != length:
                raise IntegrityError(f"{path} changed size while being uploaded (short read at {offset})")
            return self._body(out, length)

        try:
            return self._upload(key, os.fstat(fd).st_size, part)
        finally:
            os.close(fd)

    def _get_range(self, full: str, offset: int, view: memoryview, deadline: Deadline) -> None:
        """Fill ``view`` with the object's bytes from ``offset``. A connection that ends early is
        asked again for the rest (with If-Match, so a replaced object is never spliced in); an
        object that is itself shorter than the range is an IntegrityError."""
        n = len(view)
        t = self._target("reading", full)
        got = 0
        etag: str | None = None

        def attempt() -> None:
            nonlocal got, etag
            want = f"bytes={offset + got}-{offset + n - 1}"
            pace, before = Pace(deadline, self.options, n - got), got  # from the request's start
            try:
                same = {"IfMatch": etag} if etag else {}
                r = self.client.get_object(Bucket=self.bucket, Key=full, Range=want, **same)
            except bex.ClientError as exc:
                if etag and client_error_code(exc)[1] == 412:
                    raise IntegrityError(
                        f"{t.where} was replaced while it was being read (no longer ETag {etag}); read it again") from None
                raise
            etag = etag or r.get("ETag")
            body = r["Body"]
            try:
                length = int(r.get("ContentLength", n - got))
                if offset + got and not r.get("ContentRange"):
                    raise StorageError(f"S3 endpoint {t.endpoint} ignored the Range header while reading {t.where}")
                if length < n - got:
                    raise IntegrityError(
                        f"{t.where}: asked for {want} but the object holds only {r.get('ContentRange', length)}; "
                        "it is shorter than expected (it changed size, or the size recorded for it is wrong)")
                raw = getattr(body, "_raw_stream", body)
                while got < n:
                    pace.check(got - before)
                    k = read_some(raw, view[got : min(n, got + READ_CHUNK)])
                    if not k:
                        break
                    got += k
            finally:
                body.close()
            if got < n:
                raise ShortBody(f"the connection closed after {got} of {n} bytes")

        self._attempts(t, deadline, attempt)
        self._consume(n)

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        n = len(view)
        if n == 0:
            return 0
        full = self._key(key)
        deadline = self._deadline()
        if n <= self.part_size:
            self._get_range(full, offset, view, deadline)
        else:
            run_all(self._pools.here(), lambda s: self._get_range(full, offset + s, view[s : s + self.part_size], deadline),
                    range(0, n, self.part_size), deadline)
        return n

    def get_file(self, key: str, path: str | Path) -> int:
        """Download to ``path`` atomically: parallel ranged GETs into reused aligned buffers, each
        written with O_DIRECT at its offset (no page-cache writeback to wait for at fsync)."""
        full = self._key(key)
        deadline = self._deadline()
        size = self._stat(key, full, deadline).size
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(final)
        fd, direct = open_file(tmp, write=True, direct=True)
        try:
            def fetch(offset: int) -> None:
                hb = getattr(self._local, "hb", None)
                if hb is None or hb.capacity < align_up(self.part_size):
                    hb = self._local.hb = HostBuffer(align_up(self.part_size))
                n = min(self.part_size, size - offset)
                self._get_range(full, offset, hb.view[:n], deadline)
                m = n
                if direct:
                    m = align_up(n)
                    hb.array[n:m] = 0  # the padded tail is truncated away below
                try:
                    os.pwrite(fd, hb.view[:m], offset)
                except OSError as exc:
                    raise os_error(exc, final, "writing") from exc

            run_all(self._pools.here(), fetch, range(0, size, self.part_size), deadline)
            if direct and size % ALIGN:
                os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return size

    # -- metadata ----------------------------------------------------------------------------
    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, sorted. Objects whose names are not safe relative keys (an
        empty, '.' or '..' part, a leading '/', a backslash: "a//b", "dir/", "a/../b") are skipped
        with a warning, so no caller can turn one into a path outside its directory."""
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``list`` with each key's size, from the same requests."""
        base = f"{self.prefix}/" if self.prefix else ""
        t = self._target("listing", base + prefix)
        deadline = self._deadline()
        keys: dict[str, int] = {}
        refused: list[str] = []
        token: str | None = None
        while True:  # paginate: S3 returns at most 1,000 keys per call
            kw: dict[str, Any] = {"Prefix": base + prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self._request(t, deadline, self.client.list_objects_v2, **kw)
            for o in page.get("Contents", []):
                name = str(o.get("Key", ""))
                key = name[len(base) :] if name.startswith(base) else ""
                if _safe_key(key):
                    size = o.get("Size")
                    keys[key] = size if type(size) is int and size >= 0 else -1
                else:
                    refused.append(name)
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token:
                raise StorageError(f"S3 endpoint {t.endpoint} cut the listing of {t.where} short without a continuation token")
        if refused:
            warnings.warn(
                f"skipped {len(refused)} object(s) in s3://{self.bucket} whose names are not safe keys "
                f"(e.g. {refused[:3]}): empty, '.' or '..' parts, a leading '/' or a backslash; rename or delete them",
                RuntimeWarning, stacklevel=2)
        return keys

    def _stat(self, key: str, full: str, deadline: Deadline) -> ObjectInfo:
        t = self._target("reading metadata of", full)
        r = self._request(t, deadline, self.client.head_object, Key=full)
        return ObjectInfo(key, int(field(r, "ContentLength", t)), field(r, "LastModified", t).timestamp())

    def stat(self, key: str) -> ObjectInfo:
        return self._stat(key, self._key(key), self._deadline())

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
            return True
        except NotFoundError:
            return False

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._request(self._target("deleting", full), self._deadline(), self.client.delete_object, Key=full)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *): S3 answers 412 when the key exists.

        When an attempt's answer is lost and the retry finds the key taken, the object is read back:
        if it holds ``data`` this call created it, so make ``data`` unique to the caller (a run id, a
        host and pid). SeaweedFS and AWS S3 honour the condition; a server that ignores it lets two
        callers both see True."""
        full = self._key(key)
        body = bytes(data)
        t = self._target("creating", full)
        tries = 0

        def attempt() -> bool:
            nonlocal tries
            tries += 1
            try:
                answer = self.client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
            except bex.ClientError as exc:
                code, status = client_error_code(exc)
                if code != "PreconditionFailed" and status != 412:
                    raise
                return tries > 1 and self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read() == body
            field(answer, "ETag", t)  # S3 always sends one
            return True

        return self._attempts(t, self._deadline(), attempt)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        self.cleanup(prefix)
        return len(keys)

    def cleanup(self, prefix: str = "", older_than: float = 0.0) -> int:
        """Abort multipart uploads under ``prefix`` started at least ``older_than`` seconds ago
        (their parts are invisible but cost storage until aborted); returns how many.

        S3 does not say which uploads a live writer still owns: pass an ``older_than`` longer than
        any upload takes. Ages compare the server's start time with this host's clock."""
        base = f"{self.prefix}/" if self.prefix else ""
        deadline = self._deadline()
        aborted: set[tuple[str, str]] = set()
        while True:  # list again after aborting: some servers page uploads unreliably
            stale = [u for u in self._uploads(base + prefix, deadline)
                     if u.age >= older_than and (u.key, u.upload_id) not in aborted]
            if not stale:
                return len(aborted)
            for u in stale:
                try:
                    self._request(self._target("aborting upload of", u.key), deadline,
                                  self.client.abort_multipart_upload, Key=u.key, UploadId=u.upload_id)
                except NotFoundError:
                    pass  # completed or aborted by someone else meanwhile
                aborted.add((u.key, u.upload_id))

    def _uploads(self, prefix: str, deadline: Deadline) -> list[Upload]:
        """One pass over the multipart uploads under the full-key ``prefix``, page by page."""
        t = self._target("listing uploads under", prefix)
        kw: dict[str, Any] = {"Prefix": prefix, "MaxUploads": UPLOAD_PAGE}
        out: list[Upload] = []
        seen: set[tuple[str, str]] = set()
        now = time.time()
        while True:
            page = self._request(t, deadline, self.client.list_multipart_uploads, **kw)
            ups = page.get("Uploads", [])
            out.extend(Upload(field(u, "Key", t), field(u, "UploadId", t), now - field(u, "Initiated", t).timestamp())
                       for u in ups)
            if not page.get("IsTruncated") or not ups:
                return out
            # Not every server sends NextKeyMarker: the last upload of the page is the same marker.
            marker = (page.get("NextKeyMarker") or out[-1].key, page.get("NextUploadIdMarker") or out[-1].upload_id)
            if marker in seen:
                return out
            seen.add(marker)
            kw["KeyMarker"], kw["UploadIdMarker"] = marker

    def capacity(self) -> tuple[int, int] | None:
        return None  # an object store has no size to fill

    def close(self) -> None:
        self._pools.shutdown(wait=True)

    def read_small(self, key: str, limit: int) -> bytes:
        """The whole of a small object in one ranged GET (no HEAD before it that a replacement could
        outdate); an object larger than ``limit`` is a FormatError."""
        full = self._key(key)
        t = self._target("reading", full)
        deadline = self._deadline()

        def attempt() -> bytes:
            pace = Pace(deadline, self.options, limit + 1)
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes=0-{limit}")
            except bex.ClientError as exc:
                # No range of an empty object is satisfiable. Empty is a real state, not a short read:
                # SeaweedFS keeps a PUT whose connection was reset as an empty object.
                if client_error_code(exc)[1] == 416 and self.client.head_object(Bucket=self.bucket, Key=full)["ContentLength"] == 0:
                    return b""
                raise
            body = r["Body"]
            try:
                out = bytearray()
                while len(out) <= limit:
                    pace.check(len(out))
                    piece = read_piece(getattr(body, "_raw_stream", body), min(READ_CHUNK, limit + 1 - len(out)))
                    if not piece:
                        break
                    out += piece
            finally:
                body.close()
            if len(out) < int(r.get("ContentLength", len(out))):
                raise ShortBody(f"the connection closed after {len(out)} bytes")
            return bytes(out)

        data = self._attempts(t, deadline, attempt)
        if len(data) > limit:
            raise FormatError(f"{t.where} is larger than {limit} bytes; it is corrupt or hostile")
        return data
