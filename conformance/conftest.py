"""pytest wiring of the conformance suite: ``--backend NAME:VERSION``, ``--golden-dir``, and the
``pair`` / ``other`` parameters every case runs over."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.golden import GOLDEN_ROOT, GoldenDir
from conformance.pairs import GOLDEN_REQUIRED, Pair, import_error, select_pairs
from conformance.workspace import LIMITS, TIMINGS, Workspace

_PAIRS = pytest.StashKey[list[Pair]]()
_EXPLICIT = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckptfs conformance")
    group.addoption("--backend", action="append", default=[], metavar="NAME:VERSION",
                    help="run only this registered backend pair (repeatable; NAME alone = every "
                         "version); default: every registered pair")
    group.addoption("--golden-dir", default=str(GOLDEN_ROOT), metavar="DIR",
                    help=f"root of the golden checkpoints (default {GOLDEN_ROOT})")


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
def golden_root(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.getoption("--golden-dir")).resolve()


def golden_of(pair: Pair, root: Path, *, required: bool) -> GoldenDir:
    """The pair's golden directory; fails (required) or skips when it does not exist."""
    g = GoldenDir(root, pair)
    if not g.exists():
        msg = (f"no golden checkpoint for {pair} in {root}; generate it once with "
               f"`python -m conformance.make_golden --backend {pair.name}:{pair.version}` and commit it")
        if required:
            pytest.fail(msg)
        pytest.skip(msg)
    return g


@pytest.fixture
def golden(pair: Pair, golden_root: Path) -> GoldenDir:
    return golden_of(pair, golden_root, required=(pair.name, pair.version) in GOLDEN_REQUIRED)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if LIMITS:
        terminalreporter.section("ckptfs conformance: state dicts a backend may refuse")
        for (pid, case), outcome in sorted(LIMITS.items()):
            terminalreporter.write_line(f"{pid:>22}  {case:<28} {outcome[:100]}")
    if TIMINGS:
        terminalreporter.section("ckptfs conformance timings")
        for (pid, what), secs in sorted(TIMINGS.items()):
            terminalreporter.write_line(f"{pid:>22}  {what:<32} {secs:8.3f} s")
