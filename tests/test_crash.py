"""Crash consistency (tests/crash_trials.py): saving processes SIGKILLed at random moments and at
random steps of the save, for every writable backend, on local files and on the S3 endpoint;
the previous checkpoint always loads exactly, the interrupted one loads exactly or is refused as
incomplete, never partly. A reduced count here; ``make crash-trials`` runs the full one."""

from __future__ import annotations

import pytest

from tests import crash_trials
from tests.s3_fixtures import s3_options

pytestmark = pytest.mark.slow  # kills saving processes (and starts moto)

#: (timed kills, step kills) of each backend; on S3 one random step per backend (moto is slow)
TRIALS = {"local": [(1, 1)] * 4, "s3": [(0, 1)] * 4}
CALLS: dict[str, int] = {}  #: mutating storage calls per save, by backend (from the local run)


@pytest.fixture(scope="module")
def ctx():
    return crash_trials._context()


def _run(combos, ctx, tmp_path, storage) -> None:
    failures = []
    assert len(combos) == len(TRIALS[storage]) == len(crash_trials.BACKENDS)
    for c, (timed, steps) in zip(combos, TRIALS[storage]):
        tally = crash_trials.run_combo(c, timed=timed, steps=steps, seed=0, ctx=ctx,
                                       work=str(tmp_path), calls=CALLS.get(c.backend + str(c.version)))
        CALLS[c.backend + str(c.version)] = tally.calls
        failures += tally.failures
        assert tally.trials == timed + steps and tally.calls >= 3, (c.name, tally)
    assert not failures, "\n".join(failures)


def test_killed_saves_local(tmp_path, ctx):
    _run(crash_trials.combos(str(tmp_path / "ck"), None, None), ctx, tmp_path, "local")


def test_killed_saves_s3(s3, tmp_path, ctx):
    combos = [c for c in crash_trials.combos(str(tmp_path / "ck"), f"{s3.url}/crash",
                                             s3_options(s3.direct)) if c.storage == "s3"]
    _run(combos, ctx, tmp_path, "s3")
