"""Credentials never ride in a store URL: URLs are logged, printed in errors and used as metric
labels. Every way a URL reaches a store refuses ``user:password@`` with a ConfigError that says
where credentials go instead, and never repeats the secret."""

from __future__ import annotations

import pytest

from tierio.errors import ConfigError
from tierio.storage import S3Store, open_store
from tierio.storage.url import redact

SECRET = "hunter2"


@pytest.mark.parametrize("url", [
    f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix",
    f"s3://bucket/prefix?endpoint=http://AKIAEXAMPLE:{SECRET}@127.0.0.1:8333",
    f"s3://bucket/prefix?timeout=5&endpoint=https://user:{SECRET}@s3.example.com",
    f"file://user:{SECRET}@/tmp/ckpt",
])
def test_open_store_refuses_credentials_in_the_url(url):
    with pytest.raises(ConfigError, match="holds credentials.*AWS_ACCESS_KEY_ID.*AWS_PROFILE") as err:
        open_store(url)
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("source", ["argument", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_endpoint_with_credentials_is_refused_wherever_it_comes_from(source, monkeypatch):
    endpoint = f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:8333"
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    if source != "argument":
        monkeypatch.setenv(source, endpoint)
    with pytest.raises(ConfigError, match="holds credentials") as err:
        S3Store("bucket", endpoint=endpoint if source == "argument" else None)
    assert SECRET not in str(err.value)


def test_redact_strips_user_info_wherever_it_is():
    assert redact(f"s3://b/p?endpoint=http://k:{SECRET}@h:1") == "s3://b/p?endpoint=http://h:1"
    assert redact(f"s3://k:{SECRET}@b/p") == "s3://b/p"
    assert redact("/mnt/nvme/ckpt") == "/mnt/nvme/ckpt"
    assert redact("s3://b/user@example/p") == "s3://b/user@example/p"  # an '@' in a key is not user info
