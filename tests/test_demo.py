"""`make demo` runs end to end: saved on 2 ranks, loaded on 1 and 3, bit-exact, with a table."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the examples in subprocesses, on spawned ranks


# the quicker twins in `make test`: tests/test_reshard.py (saved on 2 ranks, loaded on 1 and 3)
# and the getting-started page's torchrun block (tests/test_docs_blocks.py)
@pytest.mark.extended
@pytest.mark.timeout(240)
def test_demo_runs_and_checks_bit_for_bit():
    out = subprocess.run([sys.executable, "-m", "ckptfs.demo"], capture_output=True, text=True,
                         timeout=230)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "load 2->1" in text and "load 2->3" in text
    assert text.count("bit-exact") >= 2
    assert "safetensors_chunks-1" in text
