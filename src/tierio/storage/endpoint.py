"""URLs safe to show (no credentials) and S3 endpoints checked before use.

Below both ``storage.url`` (which parses store URLs) and ``storage.s3`` (which reads the endpoint
from the environment too), so neither imports the other for it.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from tierio.errors import ConfigError

__all__ = ["CREDENTIALS_HINT", "check_endpoint", "redact"]

_USERINFO = re.compile(r"(://)[^/?#@\s]*@")  # the "user:password@" after a scheme, wherever it is in a URL
CREDENTIALS_HINT = ("URLs are logged, shown in errors and used as metric labels, so give S3 credentials as "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment or an AWS profile (AWS_PROFILE), "
                    "never in a URL")


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` (also inside an ``endpoint=`` of its query): safe to
    log and to use as a label."""
    return _USERINFO.sub(r"\1", url)


def check_endpoint(endpoint: str, source: str = "endpoint=") -> str:
    """``endpoint`` if it is an http(s) URL with a host and a valid port; a ConfigError otherwise."""
    hint = "give it as http(s)://HOST[:PORT], e.g. http://127.0.0.1:8333"
    try:
        u = urlsplit(endpoint)
        _ = u.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        raise ConfigError(f"S3 endpoint {redact(endpoint)!r} (from {source}) is not a valid URL ({exc}); {hint}") from None
    if "@" in u.netloc:
        raise ConfigError(f"S3 endpoint {redact(endpoint)!r} (from {source}) holds credentials (user:password@); "
                          f"{CREDENTIALS_HINT}")
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise ConfigError(f"S3 endpoint {endpoint!r} (from {source}) is not an http(s) URL with a host; {hint}")
    return endpoint
