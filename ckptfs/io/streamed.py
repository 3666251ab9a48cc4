"""``StreamedPart``: a part of a file whose bytes are produced only while the store writes it.

A save from CUDA tensors does not copy the state to host memory first: each chunk's bytes come
off the device through a few pinned buffers, one buffer's worth at a time, as the store writes
them (engine/memory/device_parts.py). A store that declares ``Store.streams_parts`` takes such parts
in ``put``; for any other store the engine joins a file's parts into host bytes first.

Call order: ``nbytes`` at any time -> ``stream()`` from the thread or task that writes (more
than once if the write is retried: each call streams from the start) -> each yielded view is
valid only until the next one is asked for (or the generator is closed): write or copy it
before asking -> once a stream has yielded its last view, ``crc`` is the crc32c of its bytes
when the part computes one (the engine's file checksum combines it instead of reading the
bytes again); a consumer that has every byte need not resume the stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator


class StreamedPart(ABC):
    """Bytes produced piece by piece, in order, while they are written."""

    #: crc32c of the bytes of the last ``stream()`` that yielded them all (None: not computed)
    crc: int | None = None
    #: whether the caller waits while the bytes are produced (they are still being copied out
    #: of its tensors): a store then writes the file at the caller's priority, not a background
    #: one. False for bytes already in host memory that are only read as they are written.
    awaited: bool = True

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """How many bytes ``stream()`` produces."""

    @abstractmethod
    def stream(self) -> Generator[memoryview, None, None]:
        """Consecutive flat byte views covering ``nbytes``; each valid until the next is asked
        for. A generator: a writer that stops early closes it, which ends the stream. Blocking:
        call it from a worker thread, never from the event loop."""
