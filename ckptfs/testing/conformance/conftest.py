"""pytest wiring of the conformance suite: ``--backend NAME:VERSION``, ``--golden-dir``, and the
``pair`` / ``other`` parameters every case runs over."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptfs.testing.conformance.golden import GOLDEN_ROOT, GoldenDir, golden_roots, locate
from ckptfs.testing.conformance.pairs import GOLDEN_REQUIRED, Pair, import_error, select_pairs
from ckptfs.testing.conformance.workspace import LIMITS, TIMINGS, Workspace

_PAIRS = pytest.StashKey[list[Pair]]()
_EXPLICIT = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckptfs conformance")
    group.addoption("--backend", action="append", default=[], metavar="NAME:VERSION",
                    help="run only this registered backend pair (repeatable; NAME alone = every "
                         "version); default: every registered pair")
    group.addoption("--golden-dir", action="append", default=[], metavar="DIR",
                    help="a root of golden checkpoints searched before the built-in one "
                         f"({GOLDEN_ROOT}); repeatable. A plugin passes its own")


def pytest_configure(config: pytest.Config) -> None:
    requested = config.getoption("--backend")
    try:
        config.stash[_PAIRS] = select_pairs(requested)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[_EXPLICIT] = bool(requested)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    pairs = metafunc.config.stash[_PAIRS]
    if "other" in metafunc.fixturenames:
        everyone = select_pairs(None)
        combos = [(p, o) for p in pairs for o in everyone if o != p]
        metafunc.parametrize(("pair", "other"), combos, indirect=True,
                             ids=[f"{p}->{o}" for p, o in combos])
    elif "pair" in metafunc.fixturenames:
        metafunc.parametrize("pair", pairs, indirect=True, ids=str)


def _usable(pair: Pair, explicit: bool) -> Pair:
    """``pair`` if its backend imports; otherwise skip (fail when it was asked for by name)."""
    err = import_error(pair)
    if err is not None:
        msg = f"backend {pair} is registered but cannot be imported here: {err}"
        if explicit:
            pytest.fail(msg)
        pytest.skip(msg)
    return pair


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Pair:
    """The (backend, version) under test."""
    return _usable(request.param, request.config.stash[_EXPLICIT])


@pytest.fixture
def other(request: pytest.FixtureRequest) -> Pair:
    """Another registered pair (cross-backend cases)."""
    return _usable(request.param, False)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(scope="session")
def usable_pairs(request: pytest.FixtureRequest) -> list[Pair]:
    """Selected pairs whose backend imports here."""
    return [p for p in request.config.stash[_PAIRS] if import_error(p) is None]


@pytest.fixture(scope="session")
def golden_search(request: pytest.FixtureRequest) -> list[Path]:
    """``--golden-dir`` roots first, then the built-in golden root."""
    return golden_roots(request.config.getoption("--golden-dir"))


def golden_of(pair: Pair, roots: list[Path], *, required: bool) -> GoldenDir:
    """The pair's golden directory; fails (required) or skips when no root has one."""
    g = locate(roots, pair)
    if g is None:
        msg = (f"no golden checkpoint for {pair} in {[str(r) for r in roots]}; generate it once "
               f"with `python -m ckptfs.testing.conformance.make_golden --backend "
               f"{pair.name}:{pair.version} --golden-dir DIR` and commit it")
        if required:
            pytest.fail(msg)
        pytest.skip(msg)
    return g


@pytest.fixture
def golden(request: pytest.FixtureRequest, pair: Pair, golden_search: list[Path]) -> GoldenDir:
    """Required for the built-in pairs, and for a pair named by --backend when --golden-dir is
    given (a plugin checking its own golden data)."""
    config = request.config
    required = (pair.name, pair.version) in GOLDEN_REQUIRED or (
        config.stash[_EXPLICIT] and bool(config.getoption("--golden-dir")))
    return golden_of(pair, golden_search, required=required)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if LIMITS:
        terminalreporter.section("ckptfs conformance: state dicts a backend may refuse")
        for (pid, case), outcome in sorted(LIMITS.items()):
            terminalreporter.write_line(f"{pid:>22}  {case:<28} {outcome[:100]}")
    if TIMINGS:
        terminalreporter.section("ckptfs conformance timings")
        for (pid, what), secs in sorted(TIMINGS.items()):
            terminalreporter.write_line(f"{pid:>22}  {what:<32} {secs:8.3f} s")
