"""Local steps: a save written only to the nodes' local tiers (nothing at the URL), each node's
files then copied to ``replicas`` other nodes.

Layout of a local tier (``local_dir``, one per node, shared by the node's ranks):

- ``step-<N>/``: this node's files of step N, the step's index, and ``ckptfs.tier.json``, the
  copy's record: ``{"step", "origin", "files": {name: [size, crc32c]}}`` (sizes and checksums
  as the index records them). A local step's folder has a record; the local copies a
  persistent save leaves there have none.
- ``peers/<origin>/step-<N>/``: the copy of node ``origin``'s files of step N that it sent
  here, with the index and a record naming the files that arrived intact.

A record is written last (write and rename), so a folder without one is an unfinished copy.
Save (collective over the background group; the save pipeline, engine/save/pipeline.py, with
``SaveRequest(claim=False)``): the node's leader removes its local steps at or after N
(``clear_local``: a timeline the run left by restoring an older step) -> every rank writes
into ``step-<N>/`` and the coordinator commits the index there (the pipeline) -> every node
stores a copy of the index (``share_local``) -> each leader records its node's files -> the
leaders copy them to other nodes, other failure domains first (manager/peers.py) -> each
leader keeps its newest ``keep_local`` local steps (its own and each origin's copies).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from ckptfs.dist import Comm
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.manager.peers import Nodes, nodes_of, recv_record, safe_name, send_record
from ckptfs.manager.steps import parse_step, step_dir

TIER_FILE = "ckptfs.tier.json"  #: a local copy's record
PEERS_DIR = "peers"  #: copies other nodes sent here, by origin node


def read_record(folder: str) -> dict[str, Any] | None:
    """A copy's record, or None (no record: an unfinished copy; unreadable: none)."""
    try:
        with open(os.path.join(folder, TIER_FILE), "rb") as f:
            record = json.loads(f.read())
        return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def write_record(folder: str, record: dict[str, Any]) -> None:
    tmp = os.path.join(folder, f".{TIER_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(folder, TIER_FILE))


def copies(local_dir: str) -> list[tuple[int, str, str]]:
    """The local steps' copies under ``local_dir`` with a record: (step, origin, folder); the
    origin of the node's own copies is ''."""
    out = []
    for name in _listdir(local_dir):
        step = parse_step(name)
        if step is not None and os.path.isfile(os.path.join(local_dir, name, TIER_FILE)):
            out.append((step, "", os.path.join(local_dir, name)))
    peers = os.path.join(local_dir, PEERS_DIR)
    for origin in _listdir(peers):
        for name in _listdir(os.path.join(peers, origin)):
            step = parse_step(name)
            if step is not None:
                out.append((step, origin, os.path.join(peers, origin, name)))
    return out


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def own_files(folder: str, index: Index) -> dict[str, list]:
    """The files of the index under ``folder`` with the size it records: {name: [size, crc]}."""
    out = {}
    for name, size in index.all_files.items():
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.path.getsize(path) == size:
            out[name] = [size, index.file_checksums.get(name)]
    return out


def clear_local(comm: Comm, local_dir: str, step: int, domain: str = "") -> Nodes:
    """Collective, before a local step's write: each node's leader removes its local steps at
    or after ``step``; returns the nodes (``domain``: this rank's failure domain,
    manager/peers.py)."""
    root = os.path.join(local_dir, step_dir(step))
    nodes = nodes_of(comm, domain)
    comm.run_everywhere(f"local save: clearing {root}",
                        lambda: _clear(local_dir, root, step) if nodes.leader else None)
    return nodes


def share_local(comm: Comm, nodes: Nodes, local_dir: str, step: int, *, replicas: int,
                keep_local: int) -> None:
    """Collective, once a local step is committed in ``local_dir`` (the save pipeline,
    engine/save/pipeline.py): every node stores the index, its leader records the node's files and
    copies them to ``replicas`` other nodes, then keeps its newest ``keep_local`` steps."""
    root = os.path.join(local_dir, step_dir(step))

    def index_bytes() -> bytes:
        with open(os.path.join(root, INDEX_FILE), "rb") as f:
            return f.read()

    raw = comm.run_on_coordinator("local save: reading the index", index_bytes)
    record = comm.run_everywhere(f"local save: recording {root}",
                                 lambda: _record(root, step, nodes, raw) if nodes.leader else None)
    comm.run_everywhere(f"local save: copying step {step} to other nodes",
                        lambda: replicate(comm, nodes, local_dir, record, replicas))
    if nodes.leader:
        keep_newest(local_dir, keep_local)


def _clear(local_dir: str, root: str, step: int) -> None:
    drop_local(local_dir, lambda s: s >= step)
    shutil.rmtree(root, ignore_errors=True)  # a killed attempt's files, recorded or not


def _record(root: str, step: int, nodes: Nodes, raw: bytes) -> dict[str, Any]:
    """Store the index in this node's folder (the coordinator's is there) and record the
    node's files; returns the record."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, INDEX_FILE)
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(raw)
    record = {"step": step, "origin": nodes.names[nodes.mine],
              "files": own_files(root, Index.loads(raw))}
    write_record(root, record)
    return record


def replicate(comm: Comm, nodes: Nodes, local_dir: str, record: dict[str, Any] | None,
              replicas: int) -> None:
    """The leaders send their node's copy (``record``, under ``local_dir``) to ``replicas``
    other nodes (``Nodes.targets``: other failure domains first) and receive the copies sent
    to them; the other ranks return at once. Transfers run in one order on every rank
    (manager/peers.py)."""
    if not nodes.leader or record is None:
        return
    step = record["step"]
    for src in range(nodes.count):
        for dst in nodes.targets(src, replicas):
            what = f"local save: copying step {step} from node {nodes.names[src]} to {nodes.names[dst]}"
            if src == nodes.mine:
                folder = os.path.join(local_dir, step_dir(step))
                send_record(comm, {**record, "files": {**record["files"], INDEX_FILE: [
                    os.path.getsize(os.path.join(folder, INDEX_FILE)), None]}},
                    folder, nodes.leader_of(dst), what)
            elif dst == nodes.mine:
                folder = os.path.join(local_dir, PEERS_DIR, safe_name(nodes.names[src]),
                                      step_dir(step))
                shutil.rmtree(folder, ignore_errors=True)
                got, good = recv_record(comm, folder, nodes.leader_of(src), what)
                got["files"] = {n: v for n, v in got["files"].items()
                                if n in good and n != INDEX_FILE}
                write_record(folder, got)


def drop_local(local_dir: str, which: Callable[[int], bool]) -> None:
    """Remove the local steps' copies (own and peers') whose step ``which`` picks."""
    for step, _, folder in copies(local_dir):
        if which(step):
            shutil.rmtree(folder, ignore_errors=True)


def keep_newest(local_dir: str, keep: int) -> None:
    """Keep the newest ``keep`` local steps of each origin (own and peers')."""
    by_origin: dict[str, list[tuple[int, str]]] = {}
    for step, origin, folder in copies(local_dir):
        by_origin.setdefault(origin, []).append((step, folder))
    for held in by_origin.values():
        for _, folder in sorted(held)[:-keep] if keep > 0 else held:
            shutil.rmtree(folder, ignore_errors=True)
