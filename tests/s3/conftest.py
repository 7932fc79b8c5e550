"""A real S3 server (SeaweedFS ``weed mini``) on loopback, and a Ray instance, for the S3 tests."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
from _private_ray import private_ray

from raydl.testing.s3 import SeaweedServer


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """One SeaweedFS for the session, bound to 127.0.0.1 only (asserted from its sockets)."""
    server = SeaweedServer.start(bucket="raydl-test")
    try:
        addresses = server.listening_addresses()
        assert addresses, "weed mini has no listening socket"
        assert all(ip == "127.0.0.1" for ip, _ in addresses), addresses
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3fs_client(s3_server: SeaweedServer):  # type: ignore[no-untyped-def]
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """raydl's embedded Ray (2 CPUs), in a private temp dir so it cannot join another cluster."""
    with private_ray(num_cpus=2):
        yield


@pytest.fixture(scope="session")
def jpeg_bytes():  # type: ignore[no-untyped-def]
    """Make a small grey JPEG whose pixels are all ``value``."""
    from PIL import Image

    def make(value: int, size: int = 28) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((size, size), value, dtype=np.uint8)).save(buf, format="JPEG")
        return buf.getvalue()

    return make
