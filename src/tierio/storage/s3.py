"""S3Store: an S3-compatible object store (tier 4), on boto3.

Large objects move as parallel parts: multipart upload with ``concurrency`` parts in flight, and
parallel ranged GETs read straight into the caller's buffer. An object appears under its final key
only when CompleteMultipartUpload (or a single PUT) succeeds, so a failed upload leaves nothing
visible; the upload is aborted so no parts linger. botocore's "standard" retry mode retries
throttling and 5xx answers with exponential backoff.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from tierio.errors import (
    AuthError,
    BucketNotFoundError,
    IntegrityError,
    NotFoundError,
    StorageError,
    StoreUnavailableError,
)
from tierio.io.buffers import ALIGN, HostBuffer, align_up
from tierio.io.durable import fsync_dir, temp_name
from tierio.io.files import open_file, os_error
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Buffer, ObjectInfo, check_key

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20

_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        part_size: int = 8 * MiB,
        concurrency: int = 16,
        max_attempts: int = 5,
        limiter: TokenBucket | None = None,
    ) -> None:
        if not bucket:
            raise StorageError("an S3 URL needs a bucket: s3://BUCKET/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.part_size = align_up(max(5 * MiB, part_size), MiB)  # S3 minimum; aligned for O_DIRECT
        self.concurrency = max(1, concurrency)
        self.limiter = limiter
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=Config(
                max_pool_connections=self.concurrency * 2,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=5,
                read_timeout=120,
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="tierio-s3")
        self._local = threading.local()
        where = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.url = where + (f"?endpoint={self.endpoint}" if self.endpoint else "")

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # -- helpers -----------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str | None, fn: Callable[..., T], **kw: Any) -> T:
        """Run one boto3 call, turning its exceptions into typed tierio errors."""
        where = f"s3://{self.bucket}/{self._key(key)}" if key else f"s3://{self.bucket}"
        try:
            return fn(Bucket=self.bucket, **kw)
        except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError, bex.ConnectionClosedError) as exc:
            raise StoreUnavailableError(
                f"S3 endpoint {self.endpoint or 'default AWS'} did not answer while {what} {where} ({exc}); "
                "check that the server is running and the endpoint URL is right"
            ) from None
        except bex.NoCredentialsError:
            raise AuthError(f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
        except bex.ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist at {self.endpoint or 'AWS'}; create it first") from None
            if code in _AUTH_CODES or status == 403:
                raise AuthError(f"S3 refused the credentials while {what} {where} ({code}): check the access key and secret") from None
            if code in _MISSING_CODES or status == 404:
                raise NotFoundError(f"{where} does not exist (while {what})") from None
            raise StorageError(f"S3 error while {what} {where}: {code} {err.get('Message', '')}".strip()) from None
        except bex.BotoCoreError as exc:
            raise StorageError(f"S3 client error while {what} {where}: {exc}") from None

    # -- bucket ------------------------------------------------------------------------------
    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for demos and tests)."""
        try:
            self._call("creating bucket", None, self.client.create_bucket)
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

    def _upload(self, key: str, total: int, part: Callable[[int, int], bytes | bytearray]) -> int:
        full = self._key(key)
        if total <= self.part_size:
            body = part(0, total)
            if self.limiter:
                self.limiter.consume(total)
            self._call("uploading", key, self.client.put_object, Key=full, Body=body)
            return total
        up = self._call("starting upload of", key, self.client.create_multipart_upload, Key=full)
        upload_id = up["UploadId"]

        def send(number: int, offset: int) -> dict:
            n = min(self.part_size, total - offset)
            body = part(offset, n)
            if self.limiter:
                self.limiter.consume(n)
            r = self._call("uploading part of", key, self.client.upload_part, Key=full, UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            offsets = range(0, total, self.part_size)
            parts = list(self._pool.map(send, range(1, len(offsets) + 1), offsets))
            self._call(
                "completing upload of", key, self.client.complete_multipart_upload,
                Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts},
            )
        except BaseException:
            try:  # best effort: a dead server cannot abort, and its parts were never visible anyway
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:
                pass
            raise
        return total

    # -- reads -------------------------------------------------------------------------------
    def _get_range(self, key: str, offset: int, view: memoryview) -> None:
        n = len(view)
        r = self._call("reading", key, self.client.get_object, Key=self._key(key), Range=f"bytes={offset}-{offset + n - 1}")
        body = r["Body"]
        raw = getattr(body, "_raw_stream", None)
        pos = 0
        try:
            if raw is not None and hasattr(raw, "readinto"):
                while pos < n:  # read straight into the caller's memory
                    got = raw.readinto(view[pos:])
                    if not got:
                        break
                    pos += got
            else:
                data = body.read()
                pos = min(len(data), n)
                view[:pos] = data[:pos]
        except (OSError, bex.BotoCoreError) as exc:
            raise StoreUnavailableError(f"connection lost while reading s3://{self.bucket}/{self._key(key)}: {exc}") from None
        finally:
            body.close()
        if pos != n:
            raise IntegrityError(f"s3://{self.bucket}/{self._key(key)}: got {pos} of {n} bytes at offset {offset}; the object is shorter than expected")
        if self.limiter:
            self.limiter.consume(n)

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        n = len(view)
        if n == 0:
            return 0
        starts = range(0, n, self.part_size)
        list(self._pool.map(lambda s: self._get_range(key, offset + s, view[s : s + self.part_size]), starts))
        return n

    def get_file(self, key: str, path: str | Path) -> int:
        """Download to ``path`` atomically: parallel ranged GETs into reused aligned buffers, each
        written with O_DIRECT at its offset (no page-cache writeback to wait for at fsync)."""
        size = self.stat(key).size
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
                self._get_range(key, offset, hb.view[:n])
                m = n
                if direct:
                    m = align_up(n)
                    hb.array[n:m] = 0  # the padded tail is truncated away below
                try:
                    os.pwrite(fd, hb.view[:m], offset)
                except OSError as exc:
                    raise os_error(exc, final, "writing") from exc

            list(self._pool.map(fetch, range(0, size, self.part_size)))
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
        base = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        token: str | None = None
        while True:  # paginate: S3 returns at most 1,000 keys per call
            kw: dict[str, Any] = {"Prefix": base + prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("listing", None, self.client.list_objects_v2, **kw)
            keys.extend(o["Key"][len(base) :] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        return sorted(keys)

    def stat(self, key: str) -> ObjectInfo:
        r = self._call("reading metadata of", key, self.client.head_object, Key=self._key(key))
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
            return True
        except NotFoundError:
            return False

    def delete(self, key: str) -> None:
        self._call("deleting", key, self.client.delete_object, Key=self._key(key))

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *): S3 answers 412 when the key exists."""
        try:
            self._call("creating", key, self.client.put_object, Key=self._key(key), Body=bytes(data), IfNoneMatch="*")
        except StorageError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                return False
            raise
        return True

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        self.cleanup(prefix)
        return len(keys)

    def cleanup(self, prefix: str = "", older_than: float = 0.0) -> int:
        """Abort multipart uploads under ``prefix`` started at least ``older_than`` seconds ago
        (their parts are invisible but cost storage until aborted); returns how many."""
        base = f"{self.prefix}/" if self.prefix else ""
        page = self._call("listing uploads under", None, self.client.list_multipart_uploads, Prefix=base + prefix)
        now = time.time()
        aborted = 0
        for up in page.get("Uploads", []):
            if now - up["Initiated"].timestamp() < older_than:
                continue
            self._call("aborting upload of", up["Key"][len(base):], self.client.abort_multipart_upload,
                       Key=up["Key"], UploadId=up["UploadId"])
            aborted += 1
        return aborted

    def capacity(self) -> tuple[int, int] | None:
        return None  # an object store has no size to fill

    def close(self) -> None:
        self._pool.shutdown(wait=True)
