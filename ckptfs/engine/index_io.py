"""Reading a checkpoint's index from a store; foreign checkpoints are sniffed by the backends."""

from __future__ import annotations

import logging

from ckptfs.errors import CheckpointNotFoundError, ConfigError
from ckptfs.io.store import Store
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.layout.registry import available_backends, get_backend

log = logging.getLogger(__name__)


async def read_index(store: Store) -> Index:
    """The checkpoint's index; foreign checkpoints are sniffed by the registered backends."""
    try:
        data = await store.get(INDEX_FILE)
    except FileNotFoundError:
        data = None
    if data is not None:
        return Index.loads(bytes(data), store.full_path(INDEX_FILE))
    for name, version in available_backends():
        try:
            cls = get_backend(name, version)
        except ImportError as e:  # a broken plugin must not hide the others
            (log.debug if isinstance(e, ConfigError) else log.warning)(  # debug: an extra not installed
                "ckptfs: backend %s-%s cannot be imported: %s", name, version, e)
            continue
        found = await cls.sniff(store)
        if found is not None:
            # the same rules as for an index file: paths inside the root, bounds, keys
            return Index.from_dict(found.to_dict(), f"{store.url} (read as {name}-{version})")
    raise CheckpointNotFoundError(
        f"{store.full_path(INDEX_FILE)}: no committed ckptfs checkpoint here (no index: nothing "
        f"was saved, or a save did not finish and committed nothing; `ckptfs verify {store.url}` "
        f"tells which), and no registered backend recognises the files as a foreign checkpoint"
    )
