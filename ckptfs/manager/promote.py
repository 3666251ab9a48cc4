"""A local step persisted at the URL after the fact (the preemption save: restorable from the
nodes' tiers first, then, time allowing, committed at the URL like any persistent step).

Collective over the background group, the step folder at the URL claimed by the caller
(``engine.save.commit.claimed``): every rank copies the data files it wrote from its node's tier
(``io/copy.py``), the coordinator also the backend's files; then the coordinator creates the
local step's own index at the URL (create-if-absent, the same bytes: the names, sizes and
checksums it records are those of the copies) and gives the lock back. Only then is the step
committed there. The nodes keep the local step and its copies: a restore reads it from them
(manager/recover.py) rather than from the URL, until a newer persistent step makes it redundant.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckptfs.dist import Comm
from ckptfs.engine.save.lock import release
from ckptfs.errors import CheckpointExistsError
from ckptfs.io import Store, StoreOptions, run_sync
from ckptfs.io.copy import copy_files
from ckptfs.io.local_store import LocalStore
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.manager.tier import local_options


def promote(root: str, target: Store, mine: Sequence[str], comm: Comm, *,
            store_options: StoreOptions | None) -> int:
    """Collective: copy local step ``root``'s files (``mine``: those this rank wrote) to
    ``target`` and commit its index there; returns the step's data bytes."""
    local = LocalStore(root, local_options(store_options))

    def index_bytes() -> bytes:
        with open(os.path.join(root, INDEX_FILE), "rb") as f:
            return f.read()

    raw = comm.run_on_coordinator(f"persisting {root}: reading its index", index_bytes)
    index = Index.loads(raw)
    names = sorted({*mine, *(index.backend_files if comm.is_coordinator else ())})
    comm.run_everywhere(f"persisting {root} to {target.url}",
                        lambda: run_sync(copy_files(local, target, names)))

    async def commit() -> None:
        try:
            await target.put_if_absent(INDEX_FILE, raw)
        except FileExistsError:
            raise CheckpointExistsError(
                f"{target.full_path(INDEX_FILE)} appeared while the step was persisted: "
                f"another save committed there first; it is left as it is") from None
        await release(target)

    comm.run_on_coordinator(f"persisting {root}: committing its index at {target.url}",
                            lambda: run_sync(commit()))
    return index.total_bytes

