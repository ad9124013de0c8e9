"""One funnel from what boto3, botocore and urllib3 raise to typed tierio errors, for S3Store.

Each failure is sorted into one that is worth another attempt (the endpoint did not answer, the
connection dropped, throttling, a 5xx answer) and one that is not (credentials, a missing key or
bucket, a malformed request); the retry loop in S3Store decides from that and its deadline.
"""

from __future__ import annotations

import errno
import http.client
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bex
import urllib3.exceptions as u3

from tierio.errors import (
    AuthError,
    BucketNotFoundError,
    IntegrityError,
    NotFoundError,
    StorageError,
    StoreUnavailableError,
    TierioError,
)

AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
MISSING_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}
# Worth another attempt: throttling, server-side trouble, and a conditional write that raced
# another one (S3 answers 409 ConditionalRequestConflict and asks for a retry).
TRANSIENT_CODES = {
    "Throttling", "ThrottlingException", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "ConditionalRequestConflict",
}
TRANSIENT_STATUS = {409, 429, 500, 502, 503, 504}


# Everything a request or a body read can raise that classify() sorts; anything else is a bug.
FAILURES = (bex.BotoCoreError, bex.ClientError, u3.HTTPError, http.client.HTTPException, OSError, TierioError)


class ShortBody(StoreUnavailableError):
    """The connection ended before the body the server announced was complete."""


class SlowBody(ShortBody):
    """A body kept arriving too slowly for its request's time (or its call's deadline): the rest
    is asked for again, as for a dropped connection, while another attempt still fits."""


@dataclass(frozen=True)
class Failure:
    """One failed attempt: the typed error to raise, and whether another attempt may succeed."""

    error: TierioError
    transient: bool
    reason: str  # short, for the message that ends a run of attempts
    answered: bool = False  # the endpoint answered (with an error status), as opposed to silence or a dropped connection
    refused: bool = False  # nothing listens at the endpoint: the connection was refused, at once


@dataclass(frozen=True)
class Target:
    """What a request was doing and to what, for error messages."""

    what: str  # "listing", "reading", ...
    where: str  # s3://bucket/key
    endpoint: str


def field(answer: Any, name: str, t: Target) -> Any:
    """``answer[name]``, or a StorageError when an endpoint's answer lacks it (not an S3 server?)."""
    try:
        return answer[name]
    except (KeyError, TypeError, IndexError):
        raise StorageError(f"S3 endpoint {t.endpoint} answered {t.what} {t.where} without {name}; "
                           "check that the endpoint is an S3 server") from None


def refused_error(t: Target, attempts: str = "") -> StoreUnavailableError:
    return StoreUnavailableError(
        f"S3 endpoint {t.endpoint} refused the connection while {t.what} {t.where}{attempts}: nothing listens there; "
        "check that the S3 server is running and that the endpoint's host and port are right")


def gave_up(failure: Failure, t: Target, tries: int, seconds: float, timeout: float) -> StoreUnavailableError:
    """The error that ends a run of attempts that each failed in a way worth another try."""
    if failure.refused:  # more time is not the fix: nothing listens at the endpoint
        return refused_error(t, f" ({tries} attempt(s) over {seconds:.1f} s)")
    return StoreUnavailableError(
        f"S3 endpoint {t.endpoint} {'kept failing' if failure.answered else 'did not answer in time'} "
        f"while {t.what} {t.where}: {tries} attempt(s) over {seconds:.1f} s, the last failed with {failure.reason}; "
        "check that the server is running and reachable, or give it more time with ?timeout=SECONDS on the store "
        f"URL (now {timeout:g} s)")


def client_error_code(exc: BaseException) -> tuple[str, int | None]:
    """(error code, HTTP status) of a botocore ClientError; ("", None) for anything else."""
    if not isinstance(exc, bex.ClientError):
        return "", None
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code, exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def refused(exc: BaseException) -> bool:
    """Was the connection refused (ECONNREFUSED)? botocore keeps urllib3's error in ``kwargs``,
    and urllib3 the socket's in the exception's cause or context."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
        kwargs = getattr(e, "kwargs", None)
        inner = kwargs.get("error") if isinstance(kwargs, dict) else None
        todo += [e.__cause__, e.__context__, inner if isinstance(inner, BaseException) else None]
    return False


def classify(exc: BaseException, t: Target) -> Failure:
    """Sort one of FAILURES, raised by an S3 request or while reading its body, into a Failure."""
    if isinstance(exc, TierioError):  # already typed (a short body, an integrity check, a local file)
        return Failure(exc, isinstance(exc, ShortBody), str(exc))
    if isinstance(exc, (bex.ConnectionError, bex.HTTPClientError, u3.HTTPError, http.client.HTTPException, OSError)):
        reason = f"{type(exc).__name__}: {exc}"
        if refused(exc):  # still worth another try (a server restarting), but said as what it is
            return Failure(refused_error(t), True, "connection refused", refused=True)
        return Failure(StoreUnavailableError(
            f"S3 endpoint {t.endpoint} did not answer while {t.what} {t.where} ({reason}); "
            "check that the server is running and the endpoint URL is right"), True, reason)
    if isinstance(exc, bex.NoCredentialsError):
        error = AuthError(f"no S3 credentials for {t.where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return Failure(error, False, "no credentials")
    if isinstance(exc, bex.ClientError):
        return _client_failure(exc, t)
    if isinstance(exc, bex.BotoCoreError):
        return Failure(StorageError(f"S3 client error while {t.what} {t.where}: {exc}"), False, str(exc))
    raise TypeError(f"unexpected {type(exc).__name__} from an S3 request: {exc}") from exc


def _client_failure(exc: bex.ClientError, t: Target) -> Failure:
    code, status = client_error_code(exc)
    message = str(exc.response.get("Error", {}).get("Message", ""))
    reason = f"{status} {code}".strip()
    if code == "NoSuchBucket":
        bucket = t.where.removeprefix("s3://").split("/", 1)[0]
        return Failure(BucketNotFoundError(f"bucket {bucket!r} does not exist at {t.endpoint}; create it first"), False, reason)
    if code in AUTH_CODES or status == 403:
        error = AuthError(f"S3 refused the credentials while {t.what} {t.where} ({code}): check the access key and secret")
        return Failure(error, False, reason)
    if code in MISSING_CODES or status == 404:
        return Failure(NotFoundError(f"{t.where} does not exist (while {t.what})"), False, reason)
    if code == "InvalidRange" or status == 416:
        return Failure(IntegrityError(
            f"{t.where}: the bytes asked for start past the object's end while {t.what}; the object is shorter "
            "than expected (it changed size, or the size recorded for it is wrong)"), False, reason)
    if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
        return Failure(StoreUnavailableError(
            f"S3 endpoint {t.endpoint} failed while {t.what} {t.where}: {code} {message}".strip()), True, reason, answered=True)
    return Failure(StorageError(f"S3 error while {t.what} {t.where}: {code} {message}".strip()), False, reason)
