"""Chaos trial of delta steps (tests/delta_chaos.py): manager cycles with ``delta=True`` SIGKILLed
at random moments of their save and retention; every committed step loads exactly, no reference
dangles, nothing outlives one finished cycle. A reduced count here; ``make chaos`` runs 30
cycles, local and S3."""

from __future__ import annotations

import pytest

from tests import delta_chaos
from tests.s3_fixtures import s3_options

pytestmark = pytest.mark.slow  # kills processes (and starts moto)


@pytest.fixture(scope="module")
def ctx():
    return delta_chaos._context()


def _run(url, options, tmp_path, ctx, kills: int) -> None:
    first = delta_chaos.run(url, options, 1, 0, str(tmp_path), ctx, kill_share=0.0)
    assert not first.failures, first.failures
    took, killed, references = first.took, 0, first.references
    for seed in range(1, 4 * kills + 1):  # cycles until ``kills`` of them were killed
        tally = delta_chaos.run(url, options, 1, seed, str(tmp_path), ctx, kill_share=1.0,
                                took=took * 0.8)
        assert not tally.failures, "\n".join(tally.failures)
        killed += tally.killed
        took = tally.took or took
        if killed >= kills:
            break
    assert killed >= kills
    # a cycle that finishes: what the kills left is gone, every kept step loads exact
    last = delta_chaos.run(url, options, 1, 0, str(tmp_path), ctx, kill_share=0.0)
    assert not last.failures and last.killed == 0, "\n".join(last.failures)
    assert references + last.references > 0  # the steps referenced one another


def test_killed_delta_cycles_local(tmp_path, ctx):
    _run(str(tmp_path / "run"), None, tmp_path, ctx, 2)


def test_killed_delta_cycles_s3(s3, tmp_path, ctx):
    _run(f"{s3.url}/chaos", s3_options(s3.direct), tmp_path, ctx, 1)
