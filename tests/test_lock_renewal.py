"""The save lock's renewal and the commit: a committed save leaves no lock behind, even when a
renewal is due at the moment the commit releases it (formats/README.md §8 step 6)."""

from __future__ import annotations

import torch

import ckptfs
from ckptfs.engine.save import lock
from ckptfs.layout.index import LOCK_FILE


def test_a_renewal_due_at_the_commit_never_brings_the_released_lock_back(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "RENEW_SECONDS", 0.0002)  # a renewal due at every moment
    state = {"w": torch.ones(64), "step": 1}
    for i in range(25):
        ckptfs.save(state, tmp_path / f"c{i}")
        assert not (tmp_path / f"c{i}" / LOCK_FILE).exists(), i
    ckptfs.save(state, tmp_path / "c0", overwrite=True)  # the next save finds no lock
    assert ckptfs.load_keys(tmp_path / "c0")["step"] == 1
