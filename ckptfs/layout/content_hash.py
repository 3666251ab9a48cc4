"""Content hashes of chunks (formats/README.md §2.5): ``"xxh3-128:" + 32 hex digits``, the
128-bit XXH3 hash (the ``xxhash`` package) of a chunk's raw C-order bytes. A delta save
(engine/save/delta.py) records a chunk as a reference to a base checkpoint only when its hash
equals the hash the base recorded for the same box: a 128-bit hash, not the 32-bit CRC-32C,
whose one false match in about 4 billion would be a silent wrong load."""

from __future__ import annotations

from ckptfs.io.store import Buffer

PREFIX = "xxh3-128:"


def content_hash(data: Buffer) -> str:
    """``"xxh3-128:<32 lowercase hex>"`` of ``data``'s bytes."""
    import xxhash  # on first use: only saves and checks that hash import it

    return PREFIX + xxhash.xxh3_128_hexdigest(data)
