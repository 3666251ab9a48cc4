"""The mutation harness (tools_dev/mutate.py) stays pointed at the code: every mutant's edits
match their file exactly once, so code that moves cannot leave a mutant silently stale."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from tests.test_layers import ROOT
from tools_dev.mutate import MUTANTS, check

CHECKOUT = ROOT.parent


def test_every_mutant_applies_to_the_code():
    assert check(CHECKOUT) == []


def test_a_mutant_whose_text_moved_is_reported_stale():
    moved = replace(MUTANTS[0], edits=((MUTANTS[0].edits[0][0], "text that is nowhere", "x"),))
    twice = replace(MUTANTS[0], name="twice", edits=(("engine/options.py", "\n", "\n\n"),))
    gone = replace(MUTANTS[0], name="gone", edits=(("engine/no_such_module.py", "x", "y"),))
    stale = check(CHECKOUT, (moved, twice, gone))
    assert [s.split(":")[0] for s in stale] == [MUTANTS[0].name, "twice", "gone"]
    assert "occurs 0 times" in stale[0] and "engine/no_such_module.py" in stale[2]
    assert "occurs 1 times" not in stale[1] and "occurs 0 times" not in stale[1]


@pytest.mark.slow
def test_the_check_command_runs_no_tests_and_says_how_many_apply():
    out = subprocess.run([sys.executable, "-m", "tools_dev.mutate", "--check"], cwd=CHECKOUT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"{len(MUTANTS)} of {len(MUTANTS)} mutants apply"
