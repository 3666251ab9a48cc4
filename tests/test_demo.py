"""`make demo` runs end to end: saved on 2 ranks, loaded on 1 and 3, bit-exact, with a table.
Its ``main`` runs in the test's process, its ranks on the run's pool (``pooled_ranks``)."""

from __future__ import annotations

import pytest
import torch

from ckptfs import demo

pytestmark = pytest.mark.slow  # runs the demo's ranks


@pytest.mark.pooled_ranks
@pytest.mark.timeout(240)
def test_demo_runs_and_checks_bit_for_bit(capsys):
    with torch.random.fork_rng():  # the demo seeds torch's generator: this process's is put back
        code = demo.main()
    assert code == 0, capsys.readouterr()
    text = capsys.readouterr().out
    assert "load 2->1" in text and "load 2->3" in text
    assert text.count("bit-exact") >= 2
    assert "safetensors_chunks-1" in text
