"""Progress of loads and of the manager's saves and restores: in a log (stderr not a terminal)
one summary line with bytes, seconds and GB/s, and nothing else; none without ``progress``."""

from __future__ import annotations

import re

import torch

import ckptfs

LINE = re.compile(r"^ckptfs (load|restore) (\S+): ([\d.]+) (B|kB|MB|GB) in [\d.]+ s \([\d.]+ GB/s\)$")


def _state() -> dict:
    return {"w": torch.arange(300_000.0), "b": torch.ones(7), "step": 4}


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_a_load_with_progress_prints_one_summary_of_the_bytes_it_read(tmp_path, capsys):
    ckptfs.save(_state(), tmp_path / "c")
    capsys.readouterr()
    target = {"w": torch.zeros(300_000), "b": torch.zeros(7), "step": 0}
    res = ckptfs.load(target, tmp_path / "c", progress=True)
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    m = LINE.match(lines[0])
    assert m and m.group(1) == "load" and m.group(2) == str(tmp_path / "c"), lines
    assert float(m.group(3)) == round(res.bytes_read / 1e6, 2) and m.group(4) == "MB", (lines, res)
    assert torch.equal(target["w"], _state()["w"])
    ckptfs.load(target, tmp_path / "c")
    assert capsys.readouterr().err == ""


def test_a_failed_load_prints_no_summary(tmp_path, capsys):
    ckptfs.save(_state(), tmp_path / "c")
    data = next((tmp_path / "c" / "data").rglob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:100])
    capsys.readouterr()
    try:
        ckptfs.load({"w": torch.zeros(300_000), "b": torch.zeros(7), "step": 0}, tmp_path / "c",
                    progress=True)
    except ckptfs.IntegrityError:
        pass
    else:
        raise AssertionError("a truncated file loaded")
    assert not [line for line in _lines(capsys.readouterr().err) if LINE.match(line)]


def test_the_managers_restore_shows_its_progress(tmp_path, capsys):
    with ckptfs.CheckpointManager(tmp_path / "run", ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=tmp_path / "local"), progress=True, preemption=ckptfs.PreemptionPolicy(signals=()))) as mgr:
        mgr.save_sync(1, _state())
        capsys.readouterr()
        target = {"w": torch.zeros(300_000), "b": torch.zeros(7), "step": 0}
        assert mgr.restore(target) == 1
    lines = [line for line in _lines(capsys.readouterr().err) if LINE.match(line)]
    assert len(lines) == 1 and LINE.match(lines[0]).group(1) == "restore", lines
    assert mgr.last_restore.local_bytes > 0
    assert float(LINE.match(lines[0]).group(3)) == round(mgr.last_restore.load.bytes_read / 1e6, 2)
