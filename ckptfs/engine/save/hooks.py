"""``SaveHook``: the extension point of the save pipeline (engine/save/pipeline.py).

A feature that adds a step to every save (a check, a fingerprint, an observer, later chunk
references, index segments, an export) is one ``SaveHook`` subclass put in
``SaveRequest.hooks``; every composer (``save``, ``async_save`` with either writer, the
manager's steps, the DCP plug-in, ``convert``) runs the same pipeline and so the same hooks.
Every method has a default that does nothing: a hook overrides only what it needs.

A hook keeps no state between its calls but its own **note**: what ``before_stage`` returns
is handed to ``after_stage``, whose result is handed to the hook's later calls, each of which
returns the note the next one gets (the pipeline keeps one note per hook on the staged save; a
writer process receives it with the save). A hook object is a setting: the same object may
serve many saves, and with ``writer="process"`` it is pickled to the writer process (define it
in an importable module of the engine's layer or below: the writer imports nothing above).
"""

from __future__ import annotations

import time
from abc import ABC
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfs.dist import Comm
from ckptfs.errors import CkptfsError
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.index import ChunkEntry, Index

#: a test of one block of a chunk's bytes (a flat uint8 array): True where it may hold
#: something the hook refuses (engine/save/checked_parts.py runs it right before the block's crc32c)
BlockTest = Callable[[np.ndarray], bool]

#: the named phases of a save, in order (``SaveHook.phase_done``)
PHASES = ("stage", "claim", "write", "commit")


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What ``SaveHook.after_write`` returns."""

    note: Any = None  #: the hook's note for its commit-phase calls
    #: what the hook refuses, found while writing: any rank's non-empty ``found`` removes the
    #: files of the save on every rank and raises ``refusal`` of every rank's findings
    found: tuple[Any, ...] = ()
    part: Any = None  #: this rank's part of the index, gathered to ``before_commit``


class SaveHook(ABC):  # noqa: B024 - every hook point has a default: override what you need
    """One feature's steps in a save. Call order (each call in the order of
    ``SaveRequest.hooks``; "collective": every rank calls it, same hooks, same order):

    0) ``before_stage(state_dict, rank) -> note``: every rank, local, before the state is
       described or staged (the caller's tensors as they are, e.g. on their device).
    0b) ``before_copy(chunks, note) -> (note, references)``: local, only in a save that copies
       the caller's tensors (an asynchronous save's, the manager's), only for a hook that
       overrides it and when no hook of the save ``reads_every_chunk``: ``chunks`` the chunks
       this rank would copy from CPU, contiguous tensors, as views of them, before any byte is
       copied; ``references`` ({(key, offsets, shape): ChunkEntry}) the chunks recorded as
       references to a base checkpoint instead of written, as ``chunk_reference`` returns
       them: they are neither copied nor handed to the later calls (``chunks`` there lacks
       them). The caller's tensors may change once staged: read them here, keep no view.
    1) ``after_stage(chunks, comm, note, tensors=...) -> note``: collective, once this rank's
       chunks are staged (host copies or views; ``tensors``: (dtype, shape) of every tensor of
       the checkpoint on the coordinator, None elsewhere); nothing is claimed or written.
    2) ``before_write(chunks, comm, note, early=...) -> note``: collective, the target claimed,
       nothing written; ``early`` where the hook must decide now (a checkpoint is being
       replaced, or the store cannot test bytes while writing them) rather than in 3)-5). A
       hook that refuses here raises the same error on every rank (it may run collectives).
    3) ``block_tests(chunks, note) -> [BlockTest | None, ...]``: local, in the write phase, once,
       one test (or None) per chunk this rank writes from host memory, in order; a store that
       writes in place runs each on every block of its chunk right before the block's crc32c
       (engine/save/checked_parts.py). ``chunk_reference(chunk, note) -> ChunkEntry | None``: local,
       for each chunk before it is laid out, only for a hook that overrides it: an entry
       recorded instead of writing the chunk, a reference to a base checkpoint
       (formats/README.md §2.5; engine/save/delta.py), or None to write it.
    4) ``during_write(untested, note) -> note``: local, while the I/O threads write this rank's
       files: ``untested`` the host chunks no block test runs on (the GIL is mostly free).
    5) ``after_write(suspect, note) -> WriteOutcome``: local, once this rank's files are
       written (``suspect``: the chunks a block test flagged). Then the ranks agree (one
       collective for all hooks, the one that settles the writes); a refusal removes every
       file of the save and raises ``refusal(found of every rank)`` on every rank.
       A hook may also raise from 1) or 2), on every rank alike.
       ``rank_entries(entries, note) -> entries``: local, right after 5), only for a hook that
       overrides it: this rank's index entries ((key, ChunkEntry), ...) as the hook records
       them (content hashes); a segmented save sends them from here to their segment's owner,
       so what a hook adds to a chunk row is added here, not in 6).
    6) ``before_commit(index, parts, note) -> Index``: the coordinator only, the index built
       from every rank's entries (``parts``: every rank's ``WriteOutcome.part``, by rank; a
       segmented save's index has its tensors' blocks and no chunk rows); the returned index is
       committed (root fields, per-rank segments, statistics). Composers
       whose ranks write apart from ckptfs's stage (the DCP plug-in, ``convert``) run only
       this point, with every part and the note None.
    7) ``phase_done(phase, seconds)``: every rank, local, after each phase of ``PHASES``
       (observers: timers, progress). ``refusal(found_by_rank) -> CkptfsError``: the error
       every rank raises when the hook refused in 5).

    What crosses between calls is the note (see the module doc); what crosses between ranks is
    what the pipeline gathers (``found``, ``part``), never an attribute.
    """

    def before_stage(self, state_dict: Mapping[str, Any], rank: int) -> Any:
        return None

    def reads_every_chunk(self) -> bool:
        """Whether the hook reads the bytes of every chunk of the save in its calls, those a
        hook records as references included (a check, a fingerprint): then a save copies all
        its chunks and no hook's ``before_copy`` runs. True unless a hook says otherwise."""
        return True

    def before_copy(self, chunks: Sequence[ChunkData], note: Any
                    ) -> tuple[Any, Mapping[tuple[str, tuple[int, ...], tuple[int, ...]],
                                        ChunkEntry]]:
        return note, {}

    def after_stage(self, chunks: Sequence[ChunkData], comm: Comm, note: Any, *,
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None) -> Any:
        return note

    def before_write(self, chunks: Sequence[ChunkData], comm: Comm, note: Any, *,
                     early: bool) -> Any:
        return note

    def block_tests(self, chunks: Sequence[ChunkData], note: Any) -> Sequence[BlockTest | None]:
        return [None] * len(chunks)

    def chunk_reference(self, chunk: ChunkData, note: Any) -> ChunkEntry | None:
        return None

    def during_write(self, untested: Sequence[ChunkData], note: Any) -> Any:
        return note

    def after_write(self, suspect: Sequence[ChunkData], note: Any) -> WriteOutcome:
        return WriteOutcome(note)

    def rank_entries(self, entries: Sequence[tuple[str, ChunkEntry]], note: Any
                     ) -> Sequence[tuple[str, ChunkEntry]]:
        return entries

    def before_commit(self, index: Index, parts: Sequence[Any], note: Any) -> Index:
        return index

    def phase_done(self, phase: str, seconds: float) -> None:
        return None

    def refusal(self, found_by_rank: Sequence[tuple[Any, ...]]) -> CkptfsError:
        return CkptfsError(f"{type(self).__name__} refused the save: {list(found_by_rank)}")


def overrides(hook: SaveHook, name: str) -> bool:
    """Whether ``hook`` has its own ``name`` (the pipeline skips a per-chunk call otherwise)."""
    return getattr(type(hook), name) is not getattr(SaveHook, name)


@dataclass
class PhaseTimes(SaveHook):
    """An observer: the seconds of each phase of the saves it serves on this rank, in order
    (the hook's own record, local to the process that runs the phase)."""

    seconds: list[tuple[str, float]] = field(default_factory=list)

    def reads_every_chunk(self) -> bool:
        return False

    def phase_done(self, phase: str, seconds: float) -> None:
        self.seconds.append((phase, seconds))


@contextmanager
def phase(hooks: Sequence[SaveHook], name: str) -> Iterator[None]:
    """Time the body as phase ``name`` and tell each hook once it ends without an error."""
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    for h in hooks:
        h.phase_done(name, took)
