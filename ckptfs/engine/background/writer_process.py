"""``ProcessSaver``: a ``BackgroundSaver`` whose writes run in a writer process of its own.

The training process stages as the thread writer does (``BackgroundSaver.start``), but into
shared memory (engine/memory/shm.py: ``/dev/shm`` files it owns). Once staged, the save's finishing
work (claiming the target, writing the files, checksums, building and committing the index)
runs in one persistent writer process per saver, started on first use and reused by later
saves: it receives the save's ``SaveRequest`` (a value) and runs the pipeline's named entry
point, ``engine.pipeline.finish_staged``; it imports nothing above the engine. The writer maps the
staging files once and reads the staged chunks in place.

Cross-rank agreement stays in the training process: the writer's ``Comm`` (``RemoteComm``)
sends each collective (small: outcomes, descriptions, index entries) over the pipe to the
save's background thread, which runs it on the saver's own gloo lane and sends the answer back.
So the failure discipline is ``Comm``'s: a failure on any rank fails every rank.

Faults: a writer that dies during a save (pipe EOF) fails that save's ``done`` with
``WriterError`` on its rank, drops the lane's group there, and the other ranks' next collective
fails within the collective timeout; nothing is committed (the commit is the writer's last
step). The next save starts a new writer. A writer whose training process dies notices (its
parent changes, or the pipe closes), removes the staging files of that process and exits.
``close()`` stops the writer and unlinks the files.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import itertools
import operator
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch

from ckptfs.dist import BACKGROUND, Comm
from ckptfs.dist.comm import CommStats
from ckptfs.dist.groups import drop
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.engine.memory.buffers import BufferAllocator, BufferPool, PinnedAllocator
from ckptfs.engine.memory.overflow import Overflow, bounded
from ckptfs.engine.memory.ring import Completion
from ckptfs.engine.memory.shared_ring import FedPart, FedRef, SharedOverflow, WriterRing
from ckptfs.engine.memory.shm import Mappings, SharedArena, TensorRef, unlink_orphans, unlink_owned
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.pipeline import SaveRequest, SaveResult, finish_staged
from ckptfs.engine.save.stage import StagedSave, join_plans, split_plans
from ckptfs.errors import ConfigError, WriterError
from ckptfs.io.local_store import lower_priority
from ckptfs.io.loop import get_loop
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import DType

#: the writer process's program: the package root's own module is made bare, its names (the
#: public API above the engine) loaded only if something asks for one, so the writer imports
#: the engine and what it needs, never the API; then ``main`` (argv: the package folder, the
#: socket's fd, the parent's pid)
BOOT = """
import importlib, os, sys, types
folder = sys.argv[1]
init = os.path.join(folder, "__init__.py")
package = types.ModuleType("ckptfs")
package.__path__, package.__file__ = [folder], init
def root_name(name):
    if os.path.exists(os.path.join(folder, name + ".py")) or os.path.isdir(os.path.join(folder, name)):
        return importlib.import_module("ckptfs." + name)
    del package.__getattr__
    with open(init) as f:
        exec(compile(f.read(), init, "exec"), package.__dict__)
    return getattr(package, name)
package.__getattr__ = root_name
sys.modules["ckptfs"] = package
from ckptfs.engine.background.writer_process import main
main(sys.argv[2:])
"""

#: seconds between checks that the other side is still alive
POLL = 0.2
#: seconds a writer waits for its parent to be gone after the pipe closed
PARENT_GRACE = 5.0


def shared_tensor(ref: TensorRef) -> torch.Tensor:
    """Stands in the pickle for a tensor in shared memory; a writer's unpickler maps it to its
    own ``Mappings.from_ref`` (never called elsewhere)."""
    raise WriterError("a shared-memory tensor can only be read in a writer process")


class _Pickler(pickle.Pickler):
    """Pickles tensors that lie in ``arena`` as references. A per-type ``dispatch_table``
    entry, looked up in C, so only tensors cost a Python call (a ``persistent_id`` is called
    for every object: seconds for a state of 20,000 tensors)."""

    def __init__(self, file: io.BytesIO, arena: SharedArena) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: self._tensor}
        self.arena = arena

    def _tensor(self, t: torch.Tensor) -> Any:
        ref = None if t.requires_grad else self.arena.to_ref(t)
        if ref is None:
            return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return shared_tensor, (ref,)


@dataclasses.dataclass(frozen=True)
class PlansRef:
    """Stands for the agreed plans a writer received with an earlier save (``token``)."""

    token: int


#: one chunk as it travels: key, dtype, global shape, box offsets, its data's (shared-memory
#: place or the tensor itself, torch dtype, shape)
Packed = tuple[str, DType, tuple[int, ...], tuple[int, ...], Any, torch.dtype, tuple[int, ...]]


def pack(staged: StagedSave, arena: SharedArena) -> tuple[StagedSave, list[Packed]]:
    """``staged`` without its chunks and leases (the writer does not release buffers: the
    training process does), and its chunks as plain tuples (a slotted dataclass pickles
    through Python calls: seconds for 20,000 chunks)."""
    table: list[Packed] = []
    refs = arena.flat_refs([c.data for c in staged.chunks])
    for c, ref in zip(staged.chunks, refs, strict=True):
        data: Any = ref
        if isinstance(c.source, FedPart):  # beyond host_memory_limit: the writer asks for it
            data = FedRef(c.source.index)
        elif c.source is not None:
            raise ConfigError("writer='process' cannot write streamed chunks")
        elif ref is None:
            data = c.data
        table.append((c.key, c.dtype, c.global_shape, c.box.offsets, data, c.data.dtype,
                      tuple(c.data.shape)))
    return dataclasses.replace(staged, chunks=(), leases=()), table


_SOURCE = operator.attrgetter("source")
_TENSOR = operator.attrgetter("tensor")


def staged_buffers(staged: StagedSave) -> tuple[torch.Tensor, ...] | None:
    """The staging buffers of ``staged``'s chunks, one per chunk in chunk order, where they and
    the agreed plans fix its chunk table: every chunk a copy in a buffer of its own (leased in
    chunk order), none streamed, no PerRank tensor (its dtype is not the plan's). None
    otherwise. C-level passes only: no Python call per chunk."""
    split = split_plans(staged.plans)
    if (split is None or split[1] or len(staged.leases) != len(staged.chunks)
            or list(map(_SOURCE, staged.chunks)).count(None) != len(staged.chunks)):
        return None
    return tuple(map(_TENSOR, staged.leases))


def _same_buffers(a: tuple[torch.Tensor, ...] | None, b: tuple[torch.Tensor, ...] | None) -> bool:
    """Whether ``a`` and ``b`` are the same buffer objects in the same order."""
    return a is not None and b is not None and len(a) == len(b) and all(map(operator.is_, a, b))


@dataclasses.dataclass(frozen=True, eq=False)
class _SentTable:
    """The chunk table a writer holds (built for the save of ``token``)."""

    writer: Any  #: the ``_Writer`` it was sent to
    table: list[Packed]
    token: int
    plans: int  #: token of the agreed plans it was staged with (0: none)
    buffers: tuple[torch.Tensor, ...] | None  #: ``staged_buffers`` of that save


def _in_place(table: list[Packed]) -> bool:
    """Whether every chunk of ``table`` lies in shared memory (a table the writer may keep)."""
    return all(type(data) is tuple for *_, data, _, _ in table)


def unpack(rest: StagedSave, table: list[Packed], maps: Mappings,
           ring: WriterRing | None = None) -> StagedSave:
    """What ``pack`` packed, in the writer: staged chunks as views of its mappings, and the
    chunks beyond ``host_memory_limit`` as parts streamed through ``ring``."""
    chunks = []
    for key, dtype, global_shape, offsets, data, torch_dtype, shape in table:
        if isinstance(data, FedRef):
            if ring is None:
                raise WriterError(f"key {key!r}: a streamed chunk came without its ring")
            meta = torch.empty(shape, dtype=torch_dtype, device="meta")
            chunks.append(ChunkData(key, dtype, global_shape, Box(offsets, shape), meta,
                                    ring.chunk(shape, torch_dtype, data.index)))
            continue
        if not isinstance(data, torch.Tensor):
            data = maps.flat(data).view(torch_dtype).view(shape)
        chunks.append(ChunkData(key, dtype, global_shape, Box(offsets, shape), data))
    return dataclasses.replace(rest, chunks=tuple(chunks))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, maps: Mappings) -> None:
        super().__init__(file)
        self.maps = maps

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == shared_tensor.__name__:
            return self.maps.from_ref
        return super().find_class(module, name)


class _Writer:
    """The training process's handle on one writer process: a fresh interpreter (never a
    fork, and unlike multiprocessing's spawn it does not import the caller's main module
    again), connected by a socket pair."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        package = os.path.dirname(os.path.abspath(sys.modules["ckptfs"].__file__ or ""))
        root = os.path.dirname(package)  # the folder holding the package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, package, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        self.conn = Connection(ours.detach())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def recv(self) -> Any:
        """The writer's next message; WriterError once it is gone."""
        while not self.conn.poll(POLL):
            if not self.alive:
                break
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            self.join(1)
            raise WriterError(f"the writer process (pid {self.proc.pid}) died "
                              f"(exit code {self.proc.returncode})") from e

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.join(timeout)
        if self.alive:
            self.proc.kill()
            self.join(timeout)
        self.conn.close()


class ProcessSaver(BackgroundSaver):
    """Runs asynchronous saves one at a time: staged by the training process into shared
    memory, written and committed by a writer process of its own (``writer="process"``)."""

    def __init__(self, lane: str = BACKGROUND) -> None:
        super().__init__(lane)
        self._arena = SharedArena()
        self._writer: _Writer | None = None
        #: the writer, agreed plans and token of the plans the writer keeps
        self._sent: tuple[_Writer, Any, int] | None = None
        self._nice = 0
        self._ring: list[torch.Tensor] = []  #: the shared ring of bounded saves (kept)
        self._table: _SentTable | None = None  #: the chunk table the writer holds
        self._tables = itertools.count(1)

    def writer_modules(self) -> list[str]:
        """The package's modules the writer process has imported (its first save started it;
        call between saves)."""
        with self._lock:
            self._wait_current()
            writer = self._writer_ready()
            writer.conn.send(("modules",))
            return list(writer.recv()[1])

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (None before the first save and after ``close``)."""
        w = self._writer
        return w.proc.pid if w is not None and w.alive else None

    def start(self, state_dict: Any, request: SaveRequest, *, process_group: Any,
              before: Callable[[Comm], None] | None = None,
              after: Callable[[SaveResult, Comm], SaveResult] | None = None
              ) -> tuple[Future[None], Future[SaveResult]]:
        try:  # refused here, on every rank alike, rather than in the background
            pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ConfigError(f"writer='process': the save's settings cannot be sent to the "
                              f"writer process ({type(e).__name__}: {e})") from e
        with self._lock:  # once the save in flight is done (it may replace a lost writer)
            self._wait_current()
            try:  # a new writer's interpreter starts (seconds) while this save stages
                self._writer_ready()
            except WriterError:
                pass  # the save tries again once staged, and fails there
        return super().start(state_dict, request, process_group=process_group, before=before,
                             after=after)

    def staging_pool(self, inner: BufferAllocator | None = None) -> BufferPool:
        """Always shared memory; page-locked (``cudaHostRegister``) once a save stages a
        state on CUDA (``inner``: pinned), so its device-to-host copies run asynchronously."""
        if isinstance(inner, PinnedAllocator):
            self._arena.pin()
        return super().staging_pool(self._arena)

    def bounded(self, options: SaveOptions, be: Backend) -> Overflow | None:
        """Under ``host_memory_limit`` the overflow crosses to the writer through a ring of
        shared memory (engine/memory/shared_ring.py)."""
        if bounded(options, be) is None:
            return None
        assert options.host_memory_limit is not None
        return SharedOverflow(options.host_memory_limit, options.ring_bytes, options.ring_slots,
                              self._ring_slots)

    def _ring_slots(self, count: int, size: int) -> list[torch.Tensor]:
        """``count`` shared buffers of ``size`` bytes, kept from one bounded save to the next
        of the same geometry."""
        ring = self._ring
        if len(ring) != count or ring[0].numel() != size:
            for t in ring:
                self._arena.free(t)
            ring = self._ring = [self._arena.allocate(size) for _ in range(count)]
        return ring

    def finish(self, request: SaveRequest, staged: StagedSave, comm: Comm,
               give_back: Callable[[], None]) -> SaveResult:
        """Run the pipeline's ``finish_staged`` of ``request`` in the writer; serve its
        collectives and buffer returns meanwhile."""
        writer = self._writer_ready()
        staged, token = self._known_plans(staged, writer)
        rest, tables = self._chunk_table(staged, writer, token)
        buf = io.BytesIO()
        try:
            _Pickler(buf, self._arena).dump((request, rest, tables))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            self._table = None  # never sent
            raise ConfigError(f"writer='process': the save cannot be sent to the writer "
                              f"process ({e})") from e
        fed = _fed(staged)
        ring = [self._arena.flat_ref(t) for t in fed.slots] if fed is not None else []
        meta = (comm.rank, comm.size, comm.timeout, _members(comm), set(self._arena.names), token,
                self._nice, ring)
        try:
            writer.conn.send(("job", buf.getvalue(), meta))
            return self._serve(writer, comm, give_back, fed)
        except _JobFailed as f:  # the writer is sound; the save failed (a storage error too)
            self._table = None
            raise f.error from None
        except BaseException as e:
            self._table = None  # the writer may not hold the table last sent
            if not isinstance(e, (WriterError, OSError)):
                raise
            self._lost(writer, comm)
            if isinstance(e, WriterError):
                raise
            raise WriterError(f"the writer process stopped answering: {e}") from e

    def lower_priority(self, nice: int) -> None:
        """The writer runs at nice ``nice``; this thread, which only serves its collectives,
        keeps the caller's priority (a niced thread on a busy CPU would hold the writer up)."""
        self._nice = nice

    def _known_plans(self, staged: StagedSave, writer: _Writer) -> tuple[StagedSave, int]:
        """``staged`` with its agreed plans replaced by ``PlansRef`` when ``writer`` already
        has them (the plan cache's: the same object as the last save's), and their token."""
        split = split_plans(staged.plans)
        if split is None:
            return staged, 0
        planned, own = split
        sent = self._sent
        if sent is not None and sent[0] is writer and sent[1] is planned:
            return dataclasses.replace(staged, plans=join_plans(PlansRef(sent[2]), own)), sent[2]
        token = (sent[2] if sent is not None else 0) + 1
        self._sent = (writer, planned, token)
        return staged, token

    def _chunk_table(self, staged: StagedSave, writer: _Writer, plans: int
                     ) -> tuple[StagedSave, tuple[int, list[Packed] | None]]:
        """``staged`` without its chunks, and (token, its chunk table), or (token, None) when
        ``writer`` holds that table: a save of the same structure staged into the same buffers
        (the caching allocator hands them back in order) needs no chunk records, neither
        built here nor in the writer. Known without building the table where the agreed plans
        (``plans``: their token) and the buffers fix it (``staged_buffers``): then the
        training process does no Python work per chunk once staged."""
        sent = self._table
        buffers = staged_buffers(staged)
        if (sent is not None and sent.writer is writer and plans and sent.plans == plans
                and _same_buffers(buffers, sent.buffers)):
            return dataclasses.replace(staged, chunks=(), leases=()), (sent.token, None)
        rest, table = pack(staged, self._arena)
        if sent is not None and sent.writer is writer and sent.table == table:
            return rest, (sent.token, None)
        token = next(self._tables)
        self._table = (_SentTable(writer, table, token, plans, buffers) if _in_place(table)
                       else None)
        return rest, (token, table)

    def _serve(self, writer: _Writer, comm: Comm, give_back: Callable[[], None],
               fed: SharedOverflow | None) -> Any:
        """Answer the writer until its job ends: its collectives (run on ``comm``), its copies
        out of the caller's tensors into the shared ring (``fed``), its buffer return."""
        while True:
            msg = writer.recv()
            if msg[0] in ("call", "copy"):
                try:
                    answer: tuple = ("reply", msg[1], "ret", _answer(msg, comm, fed))
                except Exception as e:
                    answer = ("reply", msg[1], "raise", pack_error(e))
                writer.conn.send(answer)
            elif msg[0] == "give_back":
                give_back()
            elif msg[0] == "done":
                result = msg[1]
                if (dataclasses.is_dataclass(result) and not isinstance(result, type)
                        and hasattr(result, "comm")):  # what moved through the collectives here
                    result = dataclasses.replace(result, comm=comm.stats.snapshot())
                return result
            else:  # "failed"
                raise _JobFailed(unpack_error(msg[1]))

    def _writer_ready(self) -> _Writer:
        w = self._writer
        if w is None or not w.alive:
            if w is not None:
                w.stop(1)
            try:
                w = self._writer = _Writer()
            except Exception as e:
                raise WriterError(f"could not start the writer process: {e}") from e
        return w

    def _lost(self, writer: _Writer, comm: Comm) -> None:
        if writer.alive:
            writer.proc.kill()
        writer.join(5)
        writer.conn.close()
        if self._writer is writer:
            self._writer = None
            try:  # a writer watches this process's shared memory at all times
                self._writer_ready()
            except WriterError:
                pass  # the next save tries again
        if comm.group is not None and comm.size > 1:
            drop(comm.group)  # the other ranks drop theirs when their collective fails

    def close(self) -> None:
        """Wait for the save in flight, stop the writer, unlink the staging files and free the
        lane's process groups (every rank calls it; a later save starts afresh)."""
        with self._lock:
            super().close()
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
            self._ring = []
            self._arena.clear()

    def _free_at_exit(self) -> None:
        super()._free_at_exit()
        if self._writer is not None:
            self._writer.stop(2)
            self._writer = None
        self._arena.clear()


def _fed(staged: StagedSave) -> SharedOverflow | None:
    """The shared overflow of a bounded save (None: every chunk was staged)."""
    for source in map(_SOURCE, staged.chunks):  # no Python call per chunk
        if source is not None and isinstance(source, FedPart):
            return source.owner
    return None


def _answer(msg: tuple, comm: Comm, fed: SharedOverflow | None) -> Any:
    """What the training process answers to a writer's ``call`` (a collective) or ``copy``."""
    if msg[0] == "call":
        _, _, name, args, kwargs = msg
        return getattr(comm, name)(*args, **kwargs)
    if fed is None:
        raise WriterError("the writer asked for a copy, but no chunk of this save is streamed")
    fed.copy(*msg[2:])
    return None


def _members(comm: Comm) -> tuple[int, ...]:
    try:
        return comm.members
    except (ValueError, RuntimeError):
        return tuple(range(comm.size))


def _encode(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# -- the writer process ---------------------------------------------------------------------
class Mailbox:
    """The writer's end of the pipe, shared by its threads (the job's, and the store's threads
    streaming chunks): requests go out tagged; a thread waiting for its answer reads whatever
    arrives and hands each answer to the thread that asked."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._answers: dict[int, tuple[str, Any]] = {}
        self._reading = False
        self._error: BaseException | None = None
        self._tags = itertools.count(1)

    def send(self, msg: tuple) -> None:
        with self._send:
            self.conn.send(msg)

    def ask(self, kind: str, *args: Any) -> int:
        """Send request ``kind``; its tag, for ``answer``."""
        with self._send:
            tag = next(self._tags)
            self.conn.send((kind, tag, *args))
        return tag

    def answer(self, tag: int) -> Any:
        """The answer to request ``tag`` (raises the error it carries, or the pipe's)."""
        with self._cond:
            while tag not in self._answers:
                if self._error is not None:
                    raise self._error
                if self._reading:
                    self._cond.wait()
                    continue
                self._reading = True
                self._cond.release()
                try:
                    msg: Any = self.conn.recv()
                except BaseException as e:
                    msg = e
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                if isinstance(msg, BaseException):
                    self._error = msg
                    raise msg
                self._answers[msg[1]] = (msg[2], msg[3])
            kind, value = self._answers.pop(tag)
        if kind == "raise":
            raise unpack_error(value)
        return value

    def completion(self, tag: int) -> Completion:
        """The answer to request ``tag`` as a copy's completion."""
        return _Answer(self, tag)


class _Answer:
    __slots__ = ("mail", "tag")

    def __init__(self, mail: Mailbox, tag: int) -> None:
        self.mail, self.tag = mail, tag

    def wait(self) -> None:
        self.mail.answer(self.tag)


class RemoteComm(Comm):
    """The writer's ``Comm``: each collective runs in the training process (over the pipe)."""

    def __init__(self, mail: Mailbox, rank: int, size: int, timeout: float,
                 members: tuple[int, ...]) -> None:  # no super().__init__: no group here
        self.distributed = size > 1
        self.group = self._callers = None
        self.timeout = timeout
        self.stats = CommStats()
        self._device = torch.device("cpu")
        self.rank, self.size = rank, size
        self._mail = mail
        self.is_coordinator, self.members = rank == 0, members

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._mail.answer(self._mail.ask("call", name, args, kwargs))

    # A world of one needs no training process (``Comm``'s own answers); otherwise objects are
    # pickled here and travel as bytes, so the training process only moves bytes.
    def barrier(self, what: str = "a barrier") -> None:
        if self.size > 1:
            self._call("barrier", what)

    def all_min(self, values: Any, what: str = "a reduction") -> list[int]:
        if self.size == 1:
            return list(values)
        return self._call("all_min", list(values), what)

    def all_gather_bytes(self, data: bytes, what: str = "an all-gather") -> list[bytes]:
        if self.size == 1:
            return [bytes(data)]
        return self._call("all_gather_bytes", data, what)

    def all_to_all_bytes(self, sends: Any, what: str = "an all-to-all") -> list[bytes]:
        if self.size == 1:
            return [bytes(sends[0])]
        return self._call("all_to_all_bytes", [bytes(b) for b in sends], what)

    def all_gather(self, obj: Any, what: str = "an all-gather") -> list[Any]:
        if self.size == 1:
            return [obj]
        return [pickle.loads(b) for b in self._call("all_gather", _encode(obj), what)]

    def gather(self, obj: Any, what: str = "a gather", *, entries: bool = False) -> Any:
        if self.size == 1:
            return [obj]
        got = self._call("gather", _encode(obj), what, entries=entries)
        return None if got is None else [pickle.loads(b) for b in got]

    def settle_gather(self, what: str, err: BaseException | None, obj: Any, *,
                      all_true: Any = None, entries: bool = False) -> tuple[dict[str, bool], Any]:
        # the training process runs each collective it is asked for: the settle, then the gather
        return self.settle(what, err, all_true=all_true), self.gather(obj, what, entries=entries)

    def broadcast(self, obj: Any, what: str = "a broadcast", *, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        return pickle.loads(self._call("broadcast", _encode(obj) if self.rank == src else None,
                                       what, src=src))

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, what: str = "a broadcast") -> None:
        raise ConfigError("tensor collectives do not run in a writer process")

    def point_to_point(self, ops: Any, what: str = "an exchange") -> None:
        raise ConfigError("tensor collectives do not run in a writer process")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    unlink_owned(parent)
    os._exit(0)


def _parent_gone(parent: int) -> None:
    """The pipe closed: if the parent is dying, clean up after it; exit in any case."""
    deadline = time.monotonic() + PARENT_GRACE
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            unlink_owned(parent)
            break
        time.sleep(POLL)
    os._exit(0)


def main(argv: list[str]) -> None:
    """The writer process's entry point: ``<socket fd> <parent pid>``."""
    serve(Connection(int(argv[0])), int(argv[1]))


def serve(conn: Connection, parent: int) -> None:
    """The writer process's loop: one job at a time until told to stop."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # the I/O loop's thread is made now, at the caller's priority, as in the training process:
    # a job lowers its own thread to ``background_nice`` (for good), the loop that serves the
    # store's bookkeeping would inherit it, and on a busy CPU every write would wait on it
    get_loop()
    unlink_orphans()
    maps = Mappings()
    mail = Mailbox(conn)
    kept: dict[int, Any] = {}  # token -> the agreed plans of the plan cache
    built: dict[int, tuple[ChunkData, ...]] = {}  # token -> the chunks of the last table
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            _parent_gone(parent)
            return
        if msg[0] == "stop":
            conn.close()
            return
        if msg[0] == "reply":  # late: its request's job has ended
            continue
        if msg[0] == "modules":  # which of the package's modules this process imported
            mail.send(("modules", sorted(m for m in sys.modules if m.split(".")[0] == "ckptfs")))
            continue
        _, payload, (rank, size, timeout, members, live, token, nice, ring) = msg
        maps.forget(live)
        lower_priority(nice)
        try:
            _run_job(mail, maps, payload, RemoteComm(mail, rank, size, timeout, members),
                     (kept, built), token, ring)
        except (EOFError, OSError):
            _parent_gone(parent)
            return


def _run_job(mail: Mailbox, maps: Mappings, payload: bytes, comm: RemoteComm,
             memo: tuple[dict[int, Any], dict[int, tuple[ChunkData, ...]]], token: int,
             ring: list[tuple[str, int, int]]) -> None:
    kept, built = memo
    try:
        request, rest, (table_token, table) = _Unpickler(io.BytesIO(payload), maps).load()
        shared = WriterRing([maps.flat(r) for r in ring],
                            lambda *a: mail.completion(mail.ask("copy", *a))) if ring else None
        staged = _with_plans(_with_chunks(rest, table_token, table, maps, shared, built), kept,
                             token)
        result = finish_staged(request, staged, comm, lambda: mail.send(("give_back",)))
        del staged
        mail.send(("done", result))
    except (EOFError, OSError) as e:
        if isinstance(e, (EOFError, BrokenPipeError, ConnectionResetError)):
            raise
        _send_failure(mail, e)
    except BaseException as e:
        _send_failure(mail, e)


def _with_chunks(rest: StagedSave, token: int, table: list[Packed] | None, maps: Mappings,
                 ring: WriterRing | None, built: dict[int, tuple[ChunkData, ...]]
                 ) -> StagedSave:
    """``rest`` with its chunks: unpacked from ``table``, or (None) those built for the table
    of ``token`` by an earlier job (kept when they all lie in shared memory)."""
    if table is None:
        if token not in built:
            raise WriterError(f"the writer process lost the chunk table of token {token}")
        return dataclasses.replace(rest, chunks=built[token])
    staged = unpack(rest, table, maps, ring)
    built.clear()
    if _in_place(table):
        built[token] = staged.chunks
    return staged


def _with_plans(staged: StagedSave, kept: dict[int, Any], token: int) -> StagedSave:
    split = split_plans(staged.plans)
    if split is None:
        return staged
    planned, own = split
    if isinstance(planned, PlansRef):
        if planned.token not in kept:
            raise WriterError(f"the writer process lost the plans of token {planned.token}")
        return dataclasses.replace(staged, plans=join_plans(kept[planned.token], own))
    kept.clear()
    kept[token] = planned
    return staged


def _send_failure(mail: Mailbox, e: BaseException) -> None:
    mail.send(("failed", pack_error(e)))


class _JobFailed(Exception):
    """The writer's job raised ``error`` (the writer itself answers on): told apart from a
    lost pipe, which is an OSError too, as a storage error is."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def pack_error(e: BaseException) -> tuple[Any, str, dict[str, Any]]:
    """``e`` as what crosses the pipe whether or not its class pickles (ckptfs's rank errors
    take other arguments than their message): its class, message and attributes."""
    for packed in ((type(e), str(e), dict(vars(e))), (WriterError, f"{type(e).__name__}: {e}", {})):
        try:
            pickle.dumps(packed)
            return packed
        except Exception:
            continue
    return (WriterError, f"{type(e).__name__}: {e}", {})


def unpack_error(packed: tuple[Any, str, dict[str, Any]]) -> BaseException:
    """The exception ``pack_error`` packed (same class, message and attributes)."""
    cls, message, attrs = packed
    e = cls.__new__(cls)
    BaseException.__init__(e, message)
    e.__dict__.update(attrs)
    return e


def new_saver(writer: str, lane: str) -> BackgroundSaver:
    """A saver of ``writer``'s kind (``"thread"`` or ``"process"``) on ``lane``."""
    if writer == "thread":
        return BackgroundSaver(lane)
    if writer == "process":
        return ProcessSaver(lane)
    raise ConfigError(f"writer must be 'thread' or 'process', got {writer!r}")
