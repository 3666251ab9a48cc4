"""Shared fixtures."""

from __future__ import annotations

import fsspec
import pytest


@pytest.fixture
def memfs():
    """A clean memory:// filesystem."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 server on 127.0.0.1 at a free port, one per session (tests/s3_fixtures.py)."""
    from tests.s3_fixtures import start_moto

    server, endpoint = start_moto()
    yield endpoint
    server.stop()


@pytest.fixture(scope="session")
def fault_proxy(moto_server):
    """The fault-injecting loopback proxy in front of moto (one per session)."""
    from tests.s3_fixtures import FaultProxy

    proxy = FaultProxy(moto_server).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def s3(moto_server, fault_proxy):
    """A clean bucket per test; ``s3.url``/``s3.options`` target moto through the proxy (no
    faults unless a test configures them), ``s3.direct`` is moto itself."""
    from types import SimpleNamespace

    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

    reset_bucket(moto_server)
    fault_proxy.reset()
    yield SimpleNamespace(url=f"s3://{BUCKET}", bucket=BUCKET, endpoint=fault_proxy.url,
                          options=s3_options(fault_proxy.url), direct=moto_server,
                          proxy=fault_proxy)
    fault_proxy.reset()
