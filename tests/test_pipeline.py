"""The save pipeline (engine/save/pipeline.py) and its hooks (engine/save/hooks.py): one composition that
every composer runs, hooks called in the documented order, the engine's staged save kept
inside the engine, and a writer process that runs the engine's entry point alone."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.engine.background.writer_process import ProcessSaver
from ckptfs.engine.save.hooks import PhaseTimes, SaveHook, WriteOutcome
from ckptfs.engine.save.pipeline import SaveRequest, run_save
from ckptfs.errors import CkptfsError
from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
from ckptfs.manager.steps import step_dir
from tests.test_layers import API, ROOT, layer


def test_no_module_outside_the_engine_uses_the_staged_save():
    """``StagedSave`` is the engine's internal value: composers hand the pipeline a
    ``SaveRequest`` and never import or build it."""
    users = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
             if p.relative_to(ROOT).parts[0] != "engine"
             and re.search(r"\bStagedSave\b", p.read_text())]
    assert users == []


def test_no_composer_runs_a_phase_of_the_save_itself():
    """The modules that composed stage, write and commit by hand now run the pipeline: none
    imports a phase function of the engine's save."""
    composers = ["save.py", "async_save.py", "manager/manager.py", "manager/tier.py",
                 "manager/replicas.py", "integrations/dcp/assemble.py", "integrations/dcp/writer.py",
                 "tools/convert.py"]
    phases = {"stage", "write", "write_rank", "commit", "build_index", "commit_index",
              "replace_target", "check_staged"}
    found = []
    for name in composers:
        for names in re.findall(r"^from ckptfs\.engine\.(?:stage|write|commit|health) import "
                                r"\(?([^)\n]*)", (ROOT / name).read_text(), re.M):
            found += [f"{name}: {n}" for n in re.split(r",\s*", names.strip()) if n in phases]
    assert found == []


@dataclass
class Recorder(SaveHook):
    """Records each call it gets (its own state), and what each call was handed."""

    calls: list[tuple[str, Any]] = field(default_factory=list)
    refuse: bool = False

    def before_stage(self, state_dict, rank):
        self.calls.append(("before_stage", rank))
        return "memo"

    def after_stage(self, chunks, comm, note, *, tensors):
        self.calls.append(("after_stage", (note, sorted(tensors or {}))))
        return "staged"

    def before_write(self, chunks, comm, note, *, early):
        self.calls.append(("before_write", (note, early)))
        return "claimed"

    def during_write(self, untested, note):
        self.calls.append(("during_write", (note, sorted(c.key for c in untested))))
        return "writing"

    def after_write(self, suspect, note):
        self.calls.append(("after_write", note))
        return WriteOutcome("written", ("bad",) if self.refuse else (), part="rank part")

    def before_commit(self, index, parts, note):
        self.calls.append(("before_commit", (note, list(parts))))
        return dataclasses.replace(index, writer={**index.writer, "hooked": True})

    def phase_done(self, phase, seconds):
        self.calls.append(("phase_done", phase))

    def refusal(self, found_by_rank):
        return CkptfsError(f"refused: {list(found_by_rank)}")


def _request(url, hooks, **kw) -> SaveRequest:
    return SaveRequest(str(url), SafetensorsChunksBackend(), hooks=tuple(hooks), **kw)


def test_hooks_are_called_in_the_documented_order(tmp_path):
    hook = Recorder()
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 4}
    run_save(state, _request(tmp_path / "c", [hook]), None)
    assert hook.calls == [
        ("before_stage", 0),
        ("after_stage", ("memo", ["w"])),
        ("phase_done", "stage"),
        ("before_write", ("staged", False)),  # a fresh local target: decided while written
        ("phase_done", "claim"),
        ("during_write", ("claimed", ["w"])),
        ("after_write", "writing"),
        ("phase_done", "write"),
        ("before_commit", ("written", ["rank part"])),
        ("phase_done", "commit"),
    ]
    assert ckptfs.load_metadata(tmp_path / "c").writer["hooked"] is True


def test_a_replacing_save_asks_the_hooks_to_decide_before_anything_is_written(tmp_path):
    ckptfs.save({"w": torch.ones(2)}, tmp_path / "c")
    hook = Recorder()
    run_save({"w": torch.zeros(2)}, _request(tmp_path / "c", [hook], overwrite=True), None)
    assert ("before_write", ("staged", True)) in hook.calls
    assert ckptfs.load_metadata(tmp_path / "c").writer["hooked"] is True


def test_a_refusal_after_the_write_removes_the_files_and_raises_the_hooks_error(tmp_path):
    with pytest.raises(CkptfsError, match=r"refused: \[\('bad',\)\]"):
        run_save({"w": torch.ones(4)}, _request(tmp_path / "c", [Recorder(refuse=True)]), None)
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]


class Referencing(SaveHook):
    def chunk_reference(self, chunk, note):
        return object()  # not a chunk entry naming a base, its range, checksum and hash


def test_a_malformed_chunk_reference_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="key 'w'.*not a whole chunk"):
        run_save({"w": torch.ones(4)}, _request(tmp_path / "c", [Referencing()]), None)
    assert not (tmp_path / "c" / ckptfs.INDEX_FILE).exists()


def test_phase_times_observes_every_phase_of_an_async_save(tmp_path):
    times = PhaseTimes()
    saver = ckptfs.BackgroundSaver()
    try:
        _, done = saver.start({"w": torch.ones(8)}, _request(tmp_path / "a", [times]),
                              process_group=None)
        done.result(120)
    finally:
        saver.close()
    assert [p for p, _ in times.seconds] == ["stage", "claim", "write", "commit"]
    assert all(s >= 0 for _, s in times.seconds)
    assert ckptfs.verify(tmp_path / "a").ok


@pytest.mark.slow
def test_the_writer_process_imports_nothing_above_the_engine(tmp_path):
    """A process writer's saves (``async_save`` with the health hook, a manager's step) run the
    engine's ``finish_staged``: the writer imports the engine and the layers below it, never
    the public API, the manager or the tools."""
    saver = ProcessSaver()
    try:
        ckptfs.async_save({"w": torch.ones(64), "n": 1}, tmp_path / "a", saver=saver,
                          writer="process", check_finite=True, stats=True).result(120)
        opts = ckptfs.ManagerOptions(save=ckptfs.SaveOptions().with_shortcuts(
            writer="process", check_finite=True))
        with ckptfs.CheckpointManager(tmp_path / "m", opts, saver=saver) as m:
            m.save_sync(1, {"w": torch.zeros(3)})
        modules = saver.writer_modules()
    finally:
        saver.close()
    assert "ckptfs.engine.save.pipeline" in modules and "ckptfs.engine.save.health" in modules
    above = [m for m in modules if m not in ("ckptfs", "ckptfs.errors") and layer(m) >= API]
    assert above == []
    assert ckptfs.load_metadata(tmp_path / "a").tensors["w"].stats is not None
    assert ckptfs.verify(tmp_path / "m" / step_dir(1)).ok


def _module_entries(fn, *, io_loop: bool = False, one: dict[str, str] | None = None,
                    ) -> dict[str, int]:
    """How many times each ckptfs module is entered while ``fn()`` runs.

    One entry is a call of a function defined in a module's source file (generated dataclass
    methods not counted; a generator or coroutine on its first call only, never on a resume)
    whose caller is another module. The caller is the nearest frame of ckptfs (or of the test)
    down the stack: a call the standard library or another package makes on ckptfs's behalf
    (``json`` calling an index's ``object_pairs_hook``, ``asyncio.run_coroutine_threadsafe``
    calling the I/O loop's ``call_soon_threadsafe``, ``contextlib`` entering a ``with``) belongs
    to the ckptfs frame that made it, so a module calling itself through a library is not
    entered. A call with no ckptfs frame under it (a thread's or the event loop's work handed
    over) is an entry. Counted in every thread started meanwhile (sys.setprofile,
    threading.setprofile); with ``io_loop`` also in the running I/O loop's thread and the
    worker threads of a fresh default executor of that loop. ``one``: modules counted as one
    (module -> name), calls between them not counted."""
    import sys
    import threading
    from collections import Counter

    counts: Counter[str] = Counter()
    resumed: set[int] = set()
    one = one or {}

    def owner(frame) -> str:
        """The module of the nearest ckptfs (or test) frame from ``frame`` down ('' if none)."""
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.partition(".")[0] in ("ckptfs", "tests"):
                return one.get(name, name)
            frame = frame.f_back
        return ""

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or "ckptfs" not in code.co_filename or code.co_filename[0] == "<":
            return
        if code.co_flags & 0x2A0:  # a generator or coroutine: its first call only
            if id(frame) in resumed:
                return
            resumed.add(id(frame))
        module = frame.f_globals.get("__name__", "")
        if one.get(module, module) != owner(frame.f_back):
            counts[one.get(module, module)] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    if io_loop:
        _profile_io_loop(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        if io_loop:
            _profile_io_loop(None)
    return dict(counts)


def _profile_io_loop(profile) -> None:
    """Set ``profile`` in the I/O loop's thread (and, when set, give the loop a fresh default
    executor, whose threads start under ``threading.setprofile``)."""
    import concurrent.futures
    import sys
    import threading

    from ckptfs.io.loop import get_loop

    loop, done = get_loop(), threading.Event()

    def install() -> None:
        sys.setprofile(profile)
        if profile is not None:
            loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())
        done.set()

    loop.call_soon_threadsafe(install)
    assert done.wait(60)


def _above_eight(counts: dict[str, int], known: dict[str, int] | None = None) -> dict[str, int]:
    """The modules of ``counts`` entered more than 8 times, or more than their ``known``
    bound (a load's: tests/test_read_schedule.py)."""
    return {m: n for m, n in counts.items() if n > max(8, (known or {}).get(m, 0))}


def test_a_save_enters_each_module_at_most_eight_times(tmp_path):
    """Following a small state dict through ``ckptfs.save`` (after a first save: imports and
    the plan cache warm), in the caller's thread and every thread started meanwhile: no ckptfs
    module, of any layer, is entered more than 8 times (``_module_entries`` says how entries
    are counted; ``-s`` prints them): the collectives (``dist.comm``: one call per collective
    step) and the runtime's lookups (one per trip to the I/O loop) included. Per-tensor work is
    handed to the lower modules in one call per rank, so a bigger state dict enters them no
    more often."""
    state = {"w": torch.randn(64, 64), "b": torch.zeros(64), "step": 3, "opt": {"m": torch.ones(8)}}
    ckptfs.save(state, tmp_path / "warm")
    counts = _module_entries(lambda: ckptfs.save(state, tmp_path / "c"))
    print("\nentries of a save:", dict(sorted(counts.items(), key=lambda mn: (-mn[1], mn[0]))))
    assert "ckptfs.engine.save.pipeline" in counts and "ckptfs.engine.save.write" in counts
    assert _above_eight(counts) == {}, counts
    more = {**state, **{f"t{i}": torch.full((16,), float(i)) for i in range(12)}}
    ckptfs.save(more, tmp_path / "warm-more")
    bigger = _module_entries(lambda: ckptfs.save(more, tmp_path / "more"))
    for m in ("ckptfs.state.shards", "ckptfs.layout.checksum", "ckptfs.layout.backend"):
        assert bigger.get(m, 0) == counts.get(m, 0), (m, bigger, counts)
