"""Tools' tensor streams reading ahead (``read_regions(..., ahead=True)``, what ``unshard``
uses): the same tensors as reading in turn; the next batch is read while the caller holds the
current one, never more than ``buffer_bytes`` held together (a larger tensor alone); a caller
that stops early or fails leaves no read running."""

from __future__ import annotations

import pytest
import torch

import ckptfs
import ckptfs.tools.source as source
from ckptfs.tools.source import Region, open_checkpoint, read_regions

MB = 1 << 20


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n // 4, generator=g) for i, n in
             enumerate([MB, MB, 3 * MB, MB, MB, MB, 5 * MB, MB])}
    ckptfs.save(state, tmp_path / "c")
    return tmp_path / "c", state


def _events(monkeypatch) -> list[tuple[str, int]]:
    """Record when a batch's reads start and when its tensors are handed over."""
    events: list[tuple[str, int]] = []
    start, finish = source._start_batch, source._finish_batch

    def started(src, batch, verify, out=None):
        events.append(("start", sum(r.nbytes for r in batch)))
        return start(src, batch, verify, out)

    def finished(s, on_batch):
        events.append(("hand", s.nbytes))
        yield from finish(s, on_batch)
        events.append(("done", s.nbytes))

    monkeypatch.setattr(source, "_start_batch", started)
    monkeypatch.setattr(source, "_finish_batch", finished)
    return events


def _most_held(events: list[tuple[str, int]]) -> int:
    held = peak = 0
    for what, n in events:
        held += n if what == "start" else -n if what == "done" else 0
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("ahead", [False, True])
def test_reading_ahead_gives_the_same_tensors_within_the_buffer(ckpt, monkeypatch, ahead):
    path, state = ckpt
    events = _events(monkeypatch)
    with open_checkpoint(path, None, None) as src:
        regions = [Region.whole(src.index.tensors[k]) for k in state]
        got = {r.entry.key: t for r, t in read_regions(src, regions, buffer_bytes=4 * MB, ahead=ahead)}
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    # 4 MiB: in turn, at most one batch of 4 MiB or the 5 MiB tensor; ahead, batches of 2 MiB,
    # two at once, and the 3 and 5 MiB tensors alone
    assert _most_held(events) == 5 * MB
    waiting = [0]  # batches started and not yet handed over, after each event
    for what, _ in events:
        waiting.append(waiting[-1] + (what == "start") - (what == "hand"))
    assert max(waiting) == (2 if ahead else 1)  # ahead: the next read runs during the handing
    sizes = [n for what, n in events if what == "start"]
    assert sizes == ([2 * MB, 3 * MB, 2 * MB, 1 * MB, 5 * MB, 1 * MB] if ahead
                     else [2 * MB, 4 * MB, 2 * MB, 5 * MB, 1 * MB])


def test_a_caller_stopping_early_leaves_no_read_running(ckpt, monkeypatch):
    path, state = ckpt
    futures = []
    start = source._start_batch

    def started(src, batch, verify, out=None):
        s = start(src, batch, verify, out)
        futures.append(s.done)
        return s

    monkeypatch.setattr(source, "_start_batch", started)
    with open_checkpoint(path, None, None) as src:
        regions = [Region.whole(src.index.tensors[k]) for k in state]
        stream = read_regions(src, regions, buffer_bytes=2 * MB, ahead=True)
        with pytest.raises(RuntimeError, match="writer failed"):
            for _region, _ in stream:
                raise RuntimeError("writer failed")
        stream.close()
        assert len(futures) == 2 and all(f.done() for f in futures)  # the one ahead waited for


@pytest.mark.parametrize("ahead", [False, True])
def test_reused_buffers_give_the_same_tensors_in_one_or_two_storages(tmp_path, ahead):
    """``reuse``: every batch within the budget lands in one buffer (two reading ahead), at
    offsets any dtype can view (odd-sized bf16 and int8 beside float64); a tensor over the budget
    gets its own; each tensor, taken before the next is asked for, holds its bytes."""
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(333, generator=g).to(torch.bfloat16),
             "b": torch.randn(1000, generator=g, dtype=torch.float64),
             "c": torch.randint(-100, 100, (77,), generator=g, dtype=torch.int8),
             "d": torch.randn(5 * MB // 4, generator=g),  # over the budget: alone
             "e": torch.randn(3, 5, generator=g), "f": torch.randn(MB // 4, generator=g)}
    ckptfs.save(state, tmp_path / "c")
    with open_checkpoint(tmp_path / "c", None, None) as src:
        regions = [Region.whole(src.index.tensors[k]) for k in state]
        got, storages = {}, set()
        for r, t in read_regions(src, regions, buffer_bytes=2 * MB, ahead=ahead, reuse=True):
            got[r.entry.key] = t.clone()  # valid until the next one is asked for
            storages.add(t.untyped_storage().data_ptr())
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    assert len(storages) == (2 if ahead else 1) + 1  # the buffers, and "d"'s own tensor


def test_reused_buffers_are_filled_again_by_later_batches(ckpt):
    """The promise a caller of ``reuse`` relies on, and its cost: a tensor kept past the next
    one of another batch is overwritten (so unshard writes each tensor before the next)."""
    path, state = ckpt
    with open_checkpoint(path, None, None) as src:
        regions = [Region.whole(src.index.tensors[k]) for k in state]
        kept = [(r.entry.key, t) for r, t in read_regions(src, regions, buffer_bytes=2 * MB,
                                                           ahead=True, reuse=True)]
    assert not all(torch.equal(t, state[k]) for k, t in kept)


def test_unshard_reports_where_its_time_went(ckpt, tmp_path, monkeypatch):
    """``UnshardResult.phases``: this rank's phases (the parts of its own files within their
    whole) and its CPU seconds; the files, copied raw from the checkpoint's files or written
    from the read engine's reused buffers, hold the saved tensors."""
    from safetensors.torch import load_file

    import ckptfs.tools.unshard as unshard_mod

    path, state = ckpt
    common = {"open", "plan", "prepare", "files", "own files", "wait for ranks", "finish"}
    for route, parts in (("raw", {"copy"}), ("engine", {"read wait", "write"})):
        if route == "engine":  # every tensor through the read engine's reused buffers
            monkeypatch.setattr(unshard_mod, "raw_runs", lambda src, entries: {})
        res = ckptfs.unshard(path, tmp_path / route, format="hf", strategy="chunks",
                             chunk_size=3 * MB, buffer_bytes=2 * MB)
        got = {}
        for f in sorted((tmp_path / route).glob("model-*.safetensors")):
            got.update(load_file(str(f)))
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
        p = res.phases
        names = [n for n, _ in p.phases]
        assert common | parts <= set(names), route
        assert all(s >= 0 for _, s in p.phases) and p.cpu_seconds > 0
        inner = sum(p.get(n) for n in ("read wait", "write", "copy", "files"))
        assert inner <= p.get("own files") <= res.seconds
        assert p.get("no such phase") == 0.0
