"""``AsyncSave.wait_staged(stream=...)``: with CUDA state the caller's stream waits on events
recorded after the device-to-host copies, and the host goes on; otherwise it blocks until
``staged``. The CPU behaviour runs for real here; the CUDA path is in test_gpu.py, and its logic
(which events a stream waits on, when the host blocks) is checked with stand-in events."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

import ckptfs
from ckptfs.async_save import AsyncSave
from ckptfs.engine.background.saver import Staged


class Stream:
    """Stands in for a ``torch.cuda.Stream``: records what it was told to wait on."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_a_stream_waits_on_the_queued_copies_and_the_host_goes_on():
    staged = Staged()
    handle = AsyncSave("mem://x", staged, Future())
    events = (object(), object())
    staged.resolve_queued(events)  # the copies are queued; ``staged`` is still pending
    stream = Stream()
    handle.wait_staged(timeout=5, stream=stream)
    assert stream.waited == list(events)
    assert not staged.done()


def test_nothing_queued_on_a_device_blocks_until_staged():
    staged = Staged()
    handle = AsyncSave("mem://x", staged, Future())
    stream = Stream()
    threading.Timer(0.2, lambda: (staged.resolve_queued(), staged.set_result(None))).start()
    handle.wait_staged(timeout=5, stream=stream)
    assert staged.done() and stream.waited == []


def test_a_staging_failure_reaches_the_stream_waiter():
    staged = Staged()
    handle = AsyncSave("mem://x", staged, Future())
    staged.resolve_queued(error=ckptfs.StorageError("copy failed"))
    with pytest.raises(ckptfs.StorageError, match="copy failed"):
        handle.wait_staged(timeout=5, stream=Stream())


def test_hand_over_waits_until_the_waiting_thread_has_returned():
    """The save's thread, once ``staged`` resolves, waits (at most a bound) for the threads
    blocked in ``result()`` to get out, before it takes the GIL for its own work."""
    staged = Staged()
    waiter = threading.Thread(target=staged.result, args=(10,))
    waiter.start()
    for _ in range(500):  # until the waiter is inside result(): hand_over times out
        if not staged.hand_over(most=0.01):
            break
        time.sleep(0.01)
    else:
        pytest.fail("the waiting thread never waited")
    staged.set_result(None)
    assert staged.hand_over(most=10)
    waiter.join(10)
    assert not waiter.is_alive()
    assert staged.hand_over(most=0)  # no one waits: returns at once


@pytest.mark.parametrize("limit", [None, 1 << 16])
def test_cpu_state_blocks_until_staged_with_or_without_a_stream(tmp_path, limit):
    """A CPU state (bounded or not): ``wait_staged(stream=...)`` is ``wait_staged()``; the
    tensors changed right after it stay out of the checkpoint."""
    state = {"w": torch.arange(64 * 1024, dtype=torch.float32), "b": torch.ones(3)}
    h = ckptfs.async_save(state, str(tmp_path / "ck"), host_memory_limit=limit)
    stream = Stream()
    h.wait_staged(timeout=60, stream=stream)
    assert h.staged.done() and stream.waited == []
    assert isinstance(h.staged, Staged) and h.staged.queued.result(0) == ()
    state["w"].fill_(-1.0)
    h.result(timeout=60)
    got = {"w": torch.empty(64 * 1024), "b": torch.empty(3)}
    ckptfs.load(got, str(tmp_path / "ck"))
    assert torch.equal(got["w"], torch.arange(64 * 1024, dtype=torch.float32))
    ckptfs.close()
