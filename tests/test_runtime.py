"""The process's resources live in one ``Runtime`` (ckptfs/runtime.py) that ``ckptfs.close()``
closes; the plan cache, one of them, is keyed by the structure it planned, so two managers
saving different structures over the same ranks keep both plans."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptfs
from ckptfs.runtime import RUNTIME, Resource, Runtime
from ckptfs.testing.ranks import run_ranks


def test_resources_are_made_once_and_closed_newest_first_by_order():
    rt, closed = Runtime(), []
    made = {name: 0 for name in "abcd"}

    def maker(name):
        def make():
            made[name] += 1
            return [name]
        return make

    a = Resource("a", maker("a"), close=lambda v: closed.append(v[0]))
    b = Resource("b", maker("b"), close=lambda v: closed.append(v[0]))
    first = Resource("first", maker("c"), close=lambda v: closed.append("first"), order=1,
                     reusable=True)
    kept = Resource("kept", maker("d"))
    for r in (first, a, kept, b):
        rt.get(r)
    assert rt.get(a) is rt.get(a) and made == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert rt.names() == ["first", "a", "kept", "b"]
    held = rt.get(first)
    rt.close()
    assert closed == ["first", "b", "a"]  # the higher order first, then the newest first
    assert rt.names() == ["first", "kept"] and rt.peek(a) is None
    assert rt.get(first) is held  # closed, and kept
    assert rt.get(a) == ["a"] and made["a"] == 2  # made anew after the close


def test_a_failing_close_does_not_keep_the_others_open():
    rt, closed = Runtime(), []

    def boom(_):
        raise RuntimeError("cannot close")

    rt.get(Resource("ok", list, close=lambda v: closed.append("ok")))
    rt.get(Resource("broken", list, close=boom))
    with pytest.raises(RuntimeError, match="cannot close"):
        rt.close()
    assert closed == ["ok"] and rt.names() == []


class _Closable:
    def __init__(self, mine: int = 0) -> None:
        self.shut, self.mine = False, mine

    def is_shut(self) -> bool:
        return self.shut


def test_a_closed_value_is_made_anew_and_swapped_restores():
    rt = Runtime()
    r = Resource("flag", _Closable, closed="is_shut")
    v = rt.get(r)
    assert rt.get(r) is v
    v.shut = True
    assert rt.get(r) is not v and not rt.get(r).shut
    held = rt.get(r)
    with rt.swapped(r, _Closable(1)) as mine:
        assert rt.get(r) is mine
    assert rt.get(r) is held
    other = Resource("other", dict)
    with rt.swapped(other, {"x": 1}):
        assert rt.names() == ["flag", "other"]
    assert rt.names() == ["flag"]


def test_forget_drops_every_resource_unclosed_and_the_next_use_makes_it_anew():
    rt, closed = Runtime(), []
    kept = Resource("kept", list)  # outlives close(): a registry's registrations
    shut = Resource("shut", list, close=lambda v: closed.append("shut"))
    first = rt.get(kept)
    first.append("registered")
    rt.get(shut)
    rt.forget()
    assert rt.names() == [] and closed == []
    assert rt.get(kept) == [] and rt.get(kept) is not first


def test_close_closes_the_process_resources_and_keeps_the_registries(tmp_path):
    from ckptfs.engine.background.defaults import SAVERS
    from ckptfs.engine.memory.copies import COPY_THREADS, copy_all
    from ckptfs.io.loop import LOOP
    from ckptfs.io.registry import STORES
    from ckptfs.layout.registry import BACKENDS
    from ckptfs.planning.plan_cache import PLANS

    ckptfs.async_save({"w": torch.ones(4)}, tmp_path / "a").result()
    src = torch.arange(1 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_all([(dst, src)], threads=2, piece=1 << 16)  # the copy threads are made
    assert torch.equal(dst, src)
    ckptfs.available_backends()
    ckptfs.io.store_protocols()
    loop = RUNTIME.get(LOOP)
    held = set(RUNTIME.names())
    for r in (SAVERS, PLANS, COPY_THREADS, BACKENDS, STORES, LOOP):
        assert r.name in held, (r.name, held)
    backends = RUNTIME.get(BACKENDS)
    ckptfs.close()
    left = set(RUNTIME.names())
    assert not left & {PLANS.name, COPY_THREADS.name} and SAVERS.name in left, left
    assert RUNTIME.get(BACKENDS) is backends and RUNTIME.get(LOOP) is loop  # kept
    copying = [t for t in threading.enumerate() if t.name.startswith("ckptfsCopy")]
    for t in copying:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in copying)
    ckptfs.async_save({"w": torch.ones(4)}, tmp_path / "b").result()  # works afresh
    assert torch.equal(ckptfs.load_keys(tmp_path / "b")["w"], torch.ones(4))
    ckptfs.close()


def _structure(rank: int, world: int, n: int, cols: int) -> dict:
    return {f"t{i}": ckptfs.ShardedTensor(torch.full((2, cols), float(i)), (2 * world, cols),
                                          (2 * rank, 0)) for i in range(n)}


def two_managers(rank: int, world: int, root: str) -> None:
    """Two managers alternate saves of different structures over the same ranks: after each
    one's first save, every save reuses its plan and plans with O(1) bytes."""
    from ckptfs.manager.steps import step_dir
    from ckptfs.planning.plan_cache import plan_cache

    states = {"a": _structure(rank, world, 400, 3), "b": _structure(rank, world, 300, 5)}
    managers = {k: ckptfs.CheckpointManager(f"{root}/{k}") for k in states}
    seen: dict[str, list[tuple[bool, int]]] = {"a": [], "b": []}
    for step in range(3):
        for k, m in managers.items():
            r = m.save_sync(step, states[k])
            seen[k].append((r.plan_cached, r.comm.object_bytes - r.comm.entry_bytes))
    for m in managers.values():
        m.close()
    for k, runs in seen.items():
        assert [cached for cached, _ in runs] == [False, True, True], (k, runs)
        if rank == 1:  # a non-coordinator: planning moved O(1) bytes once the plan was cached
            assert runs[0][1] > 20_000 and all(b < 1024 for _, b in runs[1:]), (k, runs)
    cache = plan_cache()
    assert (cache.hits, cache.misses, len(cache)) == (4, 2, 2), (cache.hits, cache.misses)
    back = ckptfs.load_keys(f"{root}/b/{step_dir(2)}", ["t299"])
    assert torch.equal(back["t299"], torch.full((2 * world, 5), 299.0))


@pytest.mark.slow
@pytest.mark.pooled_ranks  # each pooled call starts from an empty runtime: no plan of before
def test_two_managers_alternating_structures_keep_both_plans(tmp_path):
    run_ranks(2, two_managers, str(tmp_path), timeout=600)
