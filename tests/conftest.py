"""Shared fixtures, and the session-wide spec audit (tests/spec_audit.py)."""

from __future__ import annotations

import os
import tempfile

import fsspec
import pytest

from tests import spec_audit


def pytest_configure(config: pytest.Config) -> None:
    """Before any test (and so before any rank is spawned): where audit records go."""
    if not os.environ.get(spec_audit.ENV):
        config._spec_audit_dir = tempfile.TemporaryDirectory(prefix="ckptfs-spec-audit-")
        os.environ[spec_audit.ENV] = config._spec_audit_dir.name


@pytest.fixture(scope="session", autouse=True)
def spec_audit_of_every_index():
    """At the end of the session, every index the suite wrote has been through the independent
    reader: fail if any broke a rule of formats/."""
    yield
    if not spec_audit.enabled():
        return
    lines, bad = spec_audit.collect(os.environ[spec_audit.ENV])
    if bad:
        report = "\n\n".join(f"{b['test']} ({b['what']} {b['url'] or ''}):\n{b['problem']}"
                              for b in bad[:10])
        pytest.fail(f"the independent spec reader (tests/spec_reader.py) refused {len(bad)} of "
                    f"{len(lines)} checks of indexes this session wrote:\n\n{report}", pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not spec_audit.enabled():
        return
    lines, bad = spec_audit.collect(os.environ[spec_audit.ENV])
    if lines:
        kinds = {w: sum(x["what"] == w for x in lines) for w in ("index", "data")}
        seconds = sum(x.get("seconds", 0) for x in lines)
        terminalreporter.write_line(
            f"spec audit: {kinds['index']} indexes and {kinds['data']} saved checkpoints read by "
            f"tests/spec_reader.py in {seconds:.1f} s (all processes), {len(bad)} problem(s)")


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
