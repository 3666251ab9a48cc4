"""A delta step's references read from the node's copy of their base (docs/guide/delta.md).

A restore through the node-local tier (manager/tier.py) reads a reference (formats/README.md
§2.5) from the node's copy of its base when the base is a step of the same manager (a folder
beside the step at the URL, ``../step_100``) and the node's folder of that step holds the
referenced file with the size the base's index records; else from the base at the URL. The
restore sees such a reference as a plain chunk of the path ``<base>/<file>`` (the path the
read engine names a reference by, engine/load/bases.py), which the node's store serves from the
base's folder: the same routing, checks and fall-back as the step's own files (a chunk read
whole is checked against its CRC-32C as it lands, one read in part is checked whole before,
a copy at fault is read again from the URL).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from ckptfs.engine.index_io import read_root
from ckptfs.engine.load.bases import BasesStore, open_base, referenced
from ckptfs.errors import CkptfsError
from ckptfs.io.base_urls import resolve_url, split_url
from ckptfs.io.local_store import LocalStore
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.index import Index, TensorEntry


@dataclass(frozen=True)
class NodeBases:
    """The bases of a step that the node-local tier may hold: where, and what they hold."""

    #: a base URL as the index records it -> the folder of the node's copy of that step
    folders: Mapping[str, str] = field(default_factory=dict)
    #: ``<base>/<file>`` -> the size the base's index records for the file
    sizes: Mapping[str, int] = field(default_factory=dict)

    def present(self) -> bool:
        """Whether the node holds a folder of some base."""
        return any(os.path.isdir(d) for d in self.folders.values())

    def as_local(self, index: Index, paths: Collection[str] | None = None) -> Index:
        """``index`` with each reference to a base of ``folders`` whose path ``<base>/<file>``
        is among ``paths`` (None: every one) a plain chunk of that path, listed in ``files``
        with its size. A segmented index comes back whole (its rows are all in place)."""
        take = self.sizes.keys() if paths is None else set(paths) & self.sizes.keys()
        if not take:
            return index
        tensors = {k: _local_chunks(t, take) for k, t in index.tensors.items()}
        files = {**index.files, **{p: self.sizes[p] for p in take}}
        return dataclasses.replace(index, tensors=tensors, files=files, segments=None,
                                   base_urls=())

    def store(self, local: LocalStore) -> BasesStore:
        """``local`` with each path of ``sizes`` served from its base's folder (the reads
        counted in ``local.stats``)."""
        stores = {}
        for base, folder in self.folders.items():
            stores[base] = LocalStore(folder, local.options)
            stores[base].stats = local.stats
        routes: dict[str, tuple[Store, str]] = {}
        for path in self.sizes:
            for base, s in stores.items():
                if path.startswith(base + "/"):
                    routes[path] = (s, path[len(base) + 1:])
        return BasesStore(local, routes, ())


def _local_chunks(t: TensorEntry, take: Collection[str]) -> TensorEntry:
    chunks = tuple(dataclasses.replace(c, base=None, file=p)
                   if (p := referenced(c)) is not None and p in take else c for c in t.chunks)
    return dataclasses.replace(t, chunks=chunks)


def sibling_folders(index: Index, url: str, local_root: str) -> dict[str, str]:
    """Each base of ``index`` (the step at ``url``) that is a step folder beside it, with the
    folder of the node's copy beside ``local_root`` (the step's own local folder)."""
    auth, path = split_url(url)
    out = {}
    for base in index.bases:
        b_auth, b_path = split_url(resolve_url(url, base))
        if b_auth == auth and posixpath.dirname(b_path) == posixpath.dirname(path):
            name = posixpath.basename(b_path)
            out[base] = os.path.join(os.path.dirname(os.path.abspath(local_root)), name)
    return out


async def read_node_bases(remote: Store, index: Index, url: str,
                          local_root: str | None) -> NodeBases:
    """The bases of ``index`` (the step at ``url``, read through ``remote``) whose copies the
    node-local tier at ``local_root`` may hold, with their files' sizes from their indexes at
    the URL (a base that cannot be read there is left out: its references are read as they
    are, and fail there if they must)."""
    if local_root is None or not index.references:
        return NodeBases()
    folders = sibling_folders(index, url, local_root)

    async def files_of(base: str) -> dict[str, int]:
        store = await open_base(remote, resolve_url(remote.url, base))
        try:
            return dict((await read_root(store)).files)
        except (CkptfsError, OSError):
            return {}
        finally:
            await store.close()

    found = await gather_all(*(files_of(b) for b in folders))
    sizes = {f"{b}/{f}": n for b, files in zip(folders, found, strict=True) for f, n in files.items()}
    return NodeBases(folders, sizes)
