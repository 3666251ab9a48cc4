"""``writer="process"``: asynchronous saves written by a persistent writer process per rank,
fed through shared memory. Two spawned gloo ranks run every case in turn (round trip and
writer reuse, a writer killed during a save, the manager, ``close()``); a lone training process
is killed to show that its writer exits and removes its shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ckptfs
from ckptfs.engine.background import defaults, writer_process
from ckptfs.engine.memory.shm import PREFIX, SHM_DIR
from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
from ckptfs.layout.registry import register_backend
from ckptfs.testing.ranks import run_ranks
from tests.scenarios import outcomes_of, passed, run_steps
from tests.test_async_save import INDEX, check_loads, state

TIMEOUT = 6.0  #: collective timeout of the saves whose writer is killed


class SlowWrite(SafetensorsChunksBackend):
    """Writes like safetensors_chunks, a second late (time to kill the writer meanwhile)."""

    name = "test_slow_write"

    def write_rank(self, job):
        time.sleep(1.5)
        return super().write_rank(job)


def segments(pid: int | None = None) -> list[str]:
    mine = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def round_trip(rank: int, world: int, root: str) -> None:
    """Values changed after `staged` stay out; a second save reuses the writer and buffers."""
    sd = state(rank, 1.0)
    h = ckptfs.async_save(sd, f"{root}/one", writer="process")
    h.wait_staged(timeout=60)
    sd["w"].local_tensor.fill_(-5.0)
    sd["b"].fill_(-5.0)
    res = h.result(timeout=60)
    assert res.bytes_written > 0 and res.comm.collectives > 0, res
    check_loads(rank, f"{root}/one", 1.0)
    saver = defaults.default_saver("process")
    pid, files = saver.writer_pid, segments()
    assert pid is not None and files, (pid, files)
    ckptfs.async_save(state(rank, 2.0), f"{root}/two", writer="process").result(timeout=60)
    check_loads(rank, f"{root}/two", 2.0)
    assert saver.writer_pid == pid and segments() == files


def writer_killed(rank: int, world: int, root: str) -> None:
    """Rank 1's writer is SIGKILLed while it writes: `done` fails on both ranks, nothing is
    committed, the previous checkpoint loads, and the next save runs on a new writer."""
    register_backend(SlowWrite.name, 1, SlowWrite, replace=True)
    opts = ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=TIMEOUT))
    saver = defaults.default_saver("process")
    old = saver.writer_pid
    started = time.monotonic()
    h = ckptfs.async_save(state(rank, 3.0), f"{root}/killed", writer="process",
                          backend=SlowWrite.name, options=opts)
    h.wait_staged(timeout=60)
    if rank == 1:
        time.sleep(0.5)
        os.kill(old, signal.SIGKILL)
    err = h.done.exception(timeout=60)
    assert isinstance(err, ckptfs.CkptfsError), repr(err)
    if rank == 1:
        assert isinstance(err, ckptfs.WriterError), repr(err)
    assert time.monotonic() - started < 3 * TIMEOUT + 5
    assert not os.path.exists(f"{root}/killed/{INDEX}")
    check_loads(rank, f"{root}/two", 2.0)
    ckptfs.async_save(state(rank, 4.0), f"{root}/after", writer="process",
                      options=opts).result(timeout=60)
    check_loads(rank, f"{root}/after", 4.0)
    if rank == 1:
        assert saver.writer_pid not in (None, old)


def manager(rank: int, world: int, root: str) -> None:
    """A CheckpointManager with writer="process" saves steps, keeps what retention says and
    restores the latest."""
    m = ckptfs.CheckpointManager(f"{root}/mgr", ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_last=1), save=ckptfs.SaveOptions(asynchronous=ckptfs.AsyncOptions(writer="process"))))
    try:
        for step in (1, 2):
            m.save(step, state(rank, float(step))).result(timeout=60)
        assert isinstance(m.saver, writer_process.ProcessSaver) and m.saver.writer_pid
        assert m.steps() == [2]
        target = state(rank, 0.0)
        assert m.restore(target) == 2
        assert target["step"] == 2
    finally:
        m.close()


def closing(rank: int, world: int, root: str) -> None:
    """`ckptfs.close()` stops the default writer and removes every shared-memory file."""
    pid = defaults.default_saver("process").writer_pid
    assert pid is not None and segments()
    ckptfs.close()
    assert segments() == []
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid)


STEPS = (round_trip, writer_killed, manager, closing)


def scenarios(rank: int, world: int, root: str, out: str) -> None:
    run_steps(STEPS, rank, out, rank, world, root)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[str | None]]:
    root = tmp_path_factory.mktemp("writer_process")
    out = root / "out"
    out.mkdir()
    run_ranks(2, scenarios, str(root / "ck"), str(out), timeout=200)
    return outcomes_of(out, STEPS, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_round_trip_reuses_the_writer(outcomes):
    passed(outcomes, round_trip)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_writer_fails_the_save_on_every_rank(outcomes):
    passed(outcomes, writer_killed)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_manager_with_a_writer_process(outcomes):
    passed(outcomes, manager)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_close_stops_the_writer_and_frees_shared_memory(outcomes):
    passed(outcomes, closing)


TRAINER = textwrap.dedent("""
    import sys, time, torch, ckptfs
    from ckptfs.engine.background import defaults
    from tests.test_writer_process import SlowWrite
    from ckptfs.layout.registry import register_backend
    register_backend(SlowWrite.name, 1, SlowWrite, replace=True)
    root = sys.argv[1]
    state = {"w": torch.randn(256, 1024), "step": 1}
    ckptfs.async_save(state, root + "/first", writer="process").result(timeout=60)
    h = ckptfs.async_save(state, root + "/second", writer="process", backend=SlowWrite.name)
    h.wait_staged(timeout=60)
    print(defaults.default_saver("process").writer_pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_training_process_leaves_no_writer_nor_shared_memory(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], env=env, cwd=repo,
                               stdout=subprocess.PIPE, text=True)
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), line
        writer = int(line)
        assert segments(trainer.pid), "the staging buffers are in /dev/shm while saving"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while not (gone(writer) and not segments(trainer.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(writer), "the writer outlived its training process"
        assert segments(trainer.pid) == []
        assert os.path.exists(tmp_path / "first" / INDEX)
        assert not os.path.exists(tmp_path / "second" / INDEX)
        got = {"w": torch.empty(256, 1024), "step": 0}
        ckptfs.load(got, str(tmp_path / "first"))
        assert got["step"] == 1
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_settings_that_cannot_reach_the_writer_are_refused_at_once(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="writer process"):
        ckptfs.async_save({"w": torch.ones(4)}, str(tmp_path / "x"), writer="process",
                          storage_options={"credentials": lambda: "secret"})
    with pytest.raises(ckptfs.ConfigError, match="writer"):
        ckptfs.async_save({"w": torch.ones(4)}, str(tmp_path / "y"), writer="fork")
    assert defaults.default_saver("process").writer_pid is None
    ckptfs.close()
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_saves_of_one_structure_send_the_chunk_table_once(tmp_path, monkeypatch):
    """The writer keeps the chunks it built for a save; a later save of the same structure,
    staged into the same buffers, sends none, and still writes its own values; the training
    process then builds no chunk table either (``pack``). A bounded save (chunks streamed
    through the shared ring) always sends its table, and so does a save whose dtypes changed
    (staged into the same buffers)."""
    saver = writer_process.ProcessSaver("test:tables")
    sent: list[bool] = []
    packed: list[bool] = []
    known, pack = saver._chunk_table, writer_process.pack

    def spy(staged, writer, plans):
        packed.append(False)
        got = known(staged, writer, plans)
        sent.append(got[1][1] is not None)
        return got

    def packing(staged, arena):
        packed[-1] = True
        return pack(staged, arena)

    saver._chunk_table = spy
    monkeypatch.setattr(writer_process, "pack", packing)
    try:
        f32, i32 = torch.float32, torch.int32  # int32: the same bytes in the same buffers
        for i, (limit, dtype) in enumerate(((None, f32), (None, f32), (None, f32),
                                            (1 << 20, f32), (None, f32), (None, i32))):
            sd = {f"t{k}": torch.full((64, 1024), i * 10 + k, dtype=dtype) for k in range(4)}
            sd["step"] = i
            ckptfs.async_save(sd, str(tmp_path / f"s{i}"), saver=saver, writer="process",
                              host_memory_limit=limit).result(timeout=60)
            got = {f"t{k}": torch.empty(64, 1024, dtype=dtype) for k in range(4)}
            got["step"] = -1
            ckptfs.load(got, str(tmp_path / f"s{i}"))
            assert got["step"] == i and all(torch.equal(got[f"t{k}"], sd[f"t{k}"]) for k in range(4))
        assert sent == [True, False, False, True, True, True], sent
        assert packed == [True, False, False, True, True, True], packed
    finally:
        saver.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_close_keeps_the_thread_saver_and_drops_the_process_saver(tmp_path):
    """``ckptfs.close()``: the default thread saver is closed but stays the default (usable
    again at once); the default process saver is dropped, its writer stopped and its shared
    memory removed; the next process save makes a new one."""

    ckptfs.close()
    sd = {"w": torch.randn(64, 64), "step": 1}
    ckptfs.async_save(sd, str(tmp_path / "t1")).result(timeout=60)
    ckptfs.async_save(sd, str(tmp_path / "p1"), writer="process").result(timeout=60)
    thread_saver = defaults.default_saver()
    process_saver = defaults.default_saver("process")
    pid = process_saver.writer_pid
    assert pid is not None and segments()
    ckptfs.close()
    assert segments() == [] and process_saver.writer_pid is None
    assert defaults.default_saver() is thread_saver
    ckptfs.async_save(sd, str(tmp_path / "t2")).result(timeout=60)
    assert defaults.default_saver("process") is not process_saver
    ckptfs.async_save(sd, str(tmp_path / "p2"), writer="process").result(timeout=60)
    for name in ("t1", "p1", "t2", "p2"):
        got = {"w": torch.empty(64, 64), "step": 0}
        ckptfs.load(got, str(tmp_path / name))
        assert torch.equal(got["w"], sd["w"]) and got["step"] == 1
    ckptfs.close()
    assert segments() == []
