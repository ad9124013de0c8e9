"""Writes of an S3Store: one PUT for a small object, a multipart upload (parts in parallel) otherwise.

A mixin of ``S3Store`` (tierio.storage.s3), which supplies the client, the pool, the deadline and
the retried requests. An object appears only once the upload completes; a failed one is aborted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import botocore.exceptions as bex

from tierio.storage.deadline import Deadline, run_all
from tierio.storage.s3_errors import FAILURES, client_error_code, field

log = logging.getLogger("tierio.storage.s3")


class MultipartUploads:
    """The upload half of ``S3Store``; every attribute it uses is set by ``S3Store.__init__``."""

    def _upload(self, key: str, total: int, part: Callable[[int, int], bytes | bytearray]) -> int:
        full = self._key(key)
        deadline = self._deadline()
        if total <= self.part_size:
            body = part(0, total)
            self._consume(total)
            t = self._target("uploading", full)
            field(self._request(t, deadline, self.client.put_object, Key=full, Body=body), "ETag", t)  # S3 always sends one
            return total
        t = self._target("starting upload of", full)
        upload_id = field(self._request(t, deadline, self.client.create_multipart_upload, Key=full), "UploadId", t)

        def send(item: tuple[int, int]) -> dict:
            number, offset = item
            n = min(self.part_size, total - offset)
            body = part(offset, n)
            self._consume(n)
            t = self._target(f"uploading part {number} of", full)
            r = self._request(t, deadline, self.client.upload_part, Key=full, UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": field(r, "ETag", t)}

        try:
            parts = run_all(self._pools.here(), send, enumerate(range(0, total, self.part_size), 1), deadline)
            self._complete(full, upload_id, parts, total, deadline)
        except BaseException:
            self._abort(full, upload_id, deadline)
            raise
        return total

    def _complete(self, full: str, upload_id: str, parts: list[dict], total: int, deadline: Deadline) -> None:
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                      MultipartUpload={"Parts": parts})
            except bex.ClientError as exc:
                # An earlier attempt may have completed the upload and lost only its answer: the
                # upload is then gone and the object is there, with this upload's size.
                if tries == 1 or client_error_code(exc)[0] != "NoSuchUpload" or self._size(full) != total:
                    raise

        self._attempts(self._target("completing upload of", full), deadline, attempt)

    def _size(self, full: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])
        except bex.ClientError:
            return None

    def _abort(self, full: str, upload_id: str, deadline: Deadline) -> None:
        """Best effort, once, and only while the deadline allows: a dead endpoint cannot abort
        anything, and ``cleanup`` aborts what is left once it is back."""
        if not deadline.allows(self.options.attempt_seconds):
            log.warning("left the multipart upload of s3://%s/%s for cleanup: %s has no time left to abort it",
                        self.bucket, full, self.endpoint)
            return
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except FAILURES as exc:
            log.warning("could not abort the multipart upload of s3://%s/%s (%s); cleanup aborts it later",
                        self.bucket, full, exc)
