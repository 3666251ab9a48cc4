"""Restoring a local step from the copies the surviving nodes hold (manager/replicas.py).

Choosing (collective): each node's leader lists the copies its tier holds (its own and those
other nodes sent), every file with the size its step's index records; the newest local step
at or after the newest persistent step (a preemption's local step is persisted too: its
copies spare the URL) whose files are all held somewhere is restored. Its
bytes are checked as they are used: every chunk read whole against its crc32c as it lands, and
every file fetched from another node against the file's crc32c as it arrives; only the files
some rank reads a chunk of in part (another layout) are checked whole before (by the node that
will serve them). If any check fails, the choice is made again with every copy to be read
checked whole first (``verify``): a step whose files are all still held intact by some node is
restorable, else the next older one is tried, and when none is the manager restores the newest
persistent step (the reasons say why each local step was passed).

Reading (collective): every rank plans its reads against the step's index (as ``load``
reshards: any world size) and names the files they touch; each node's leader links the files
its node holds into a scratch folder and receives the others from the nearest node holding
them (ring order), checked against their crc32c as they land (manager/peers.py). Then every
rank fills its state from its node's scratch folder (the read engine checking every chunk it
reads whole, unless every file was checked whole in the choice), and the leader removes the
folder.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.load.targets import plan_targets
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import IntegrityError, MalformedIndexError, MissingKeysError
from ckptfs.io import StoreOptions
from ckptfs.io.local_store import LocalStore
from ckptfs.io.routed import RoutedStore
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.load import fill
from ckptfs.manager.peers import PIECE_BYTES, Nodes, file_crc, nodes_of, recv_file, send_file
from ckptfs.manager.replicas import copies, read_record
from ckptfs.manager.tier import RestoreResult, chunks_read, local_options

SCRATCH_DIR = ".restore"  #: under a local tier: the files a restore reads, gathered


@dataclass(frozen=True)
class Held:
    """What one node holds of one local step: file -> its path there (size as indexed)."""

    step: int
    files: dict[str, str]
    index: bytes  #: the step's index as the copy holds it (its own checksum verified)


@dataclass(frozen=True)
class Choice:
    """The local step to restore and where each of its files is held intact (node indexes);
    or None with the reasons each local step was passed."""

    step: int | None
    holders: dict[str, list[int]]
    index: bytes
    reasons: tuple[str, ...]
    nodes: Nodes  #: the group's nodes
    mine: dict[int, Held]  #: what this node holds (its leader; empty elsewhere)
    verified: bool = False  #: every copy to be read was checked whole against its crc32c
    read: tuple[str, ...] = ()  #: the files this rank's reads touch
    need: tuple[frozenset[str], ...] = ()  #: the files each node's ranks read


def scan(local_dir: str | None) -> dict[int, Held]:
    """The local steps this node holds copies of, by step (every copy of a step merged)."""
    out: dict[int, Held] = {}
    for step, _, folder in copies(local_dir) if local_dir else []:
        record = read_record(folder)
        try:
            with open(os.path.join(folder, INDEX_FILE), "rb") as f:
                raw = f.read()
            index = Index.loads(raw)
        except (OSError, MalformedIndexError, IntegrityError):
            continue
        if record is None:
            continue
        files = {n: os.path.join(folder, n) for n in record["files"]
                 if n in index.all_files and _size(os.path.join(folder, n)) == index.all_files[n]}
        held = out.setdefault(step, Held(step, {}, raw))
        for n, path in files.items():
            held.files.setdefault(n, path)
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def choose(comm: Comm, local_dir: str | None, from_step: int | None,
           state_dict: dict[str, Any], *, only: int | None = None, strict: bool = True,
           verify: bool = False) -> Choice:
    """Collective: the newest local step at or after ``from_step`` (or exactly ``only``) whose
    files the reads of ``state_dict`` touch the nodes hold between them (module doc).
    ``verify``: held intact, every copy to be read checked whole; else only those read in part."""
    nodes = nodes_of(comm)
    mine = scan(local_dir) if nodes.leader else {}
    summary = {s: (sorted(h.files), h.index) for s, h in mine.items()}
    every = comm.all_gather(summary, "restore: listing the local tiers' steps")
    steps = sorted({s for per in every for s in per}, reverse=True)
    reasons: list[str] = []
    for step in steps:
        if (only is not None and step != only) or (only is None and from_step is not None
                                                    and step < from_step):
            continue
        raw = next(per[step][1] for per in every if step in per)
        index = Index.loads(raw)
        read, need, partial = _needs(comm, nodes, state_dict, index, f"local step {step}", strict)
        holders = _holders(every, nodes, step)
        wanted = set().union(*need)
        if _missing(step, wanted, holders, reasons, "no node holds"):
            continue
        check = need if verify else partial
        if any(check):
            holders = _check(comm, nodes, mine.get(step), index, check, holders)
        if _missing(step, wanted, holders, reasons, "no intact copy (crc32c) of"):
            continue
        return Choice(step, holders, raw, tuple(reasons), nodes, mine, verify, tuple(read),
                      tuple(frozenset(n) for n in need))
    return Choice(None, {}, b"", tuple(reasons), nodes, mine, verify)


def _needs(comm: Comm, nodes: Nodes, state_dict: dict[str, Any], index: Index, where: str,
           strict: bool) -> tuple[list[str], list[set[str]], list[set[str]]]:
    """Collective: the files this rank reads, those each node's ranks read, and those of them
    the read engine cannot check as they land (a chunk read in part, or without a checksum),
    to fill their ``state_dict`` from ``index`` (planned as ``load`` plans them: any world
    size and layout)."""

    def plan() -> tuple[list[str], list[str]]:
        p = plan_targets(state_dict, index, comm.rank)
        if strict and p.missing:
            raise MissingKeysError(where, list(p.missing))
        read, partial = chunks_read(p.reads)
        unchecked = {f for f, held in read.items() if any(c.checksum is None for _, c in held)}
        return sorted(read), sorted(unchecked | partial.keys())

    (read, _), wanted = comm.run_everywhere(f"restore: planning the reads of {where}", plan,
                                            lambda files: files, to="all")

    def per_node(i: int) -> list[set[str]]:
        return [set().union(*(wanted[r][i] for r in nodes.layout.ranks_on(n)))
                for n in range(nodes.count)]

    return read, per_node(0), per_node(1)


def _check(comm: Comm, nodes: Nodes, held: Held | None, index: Index, need: list[set[str]],
           holders: dict[str, list[int]]) -> dict[str, list[int]]:
    """Collective: ``holders`` less the copies found spoiled. Each node checks the crc32c of
    the copies it would serve (the nearest holder of a file a node needs), round after round
    until every copy to be served checked intact or a file has no holder left."""
    checked: set[str] = set()
    while True:
        serve = {f for d, files in enumerate(need) for f in files
                 if holders.get(f) and nodes.nearest(d, holders[f]) == nodes.mine} - checked
        checked |= serve
        bad = comm.run_everywhere("restore: checking the local copies to be read",
                                  lambda: serve - _intact(held, index, serve),  # noqa: B023
                                  lambda b: b, to="all")[1]
        if not any(bad):
            return holders
        holders = {f: [n for n in hs if f not in bad[nodes.leader_of(n)]]
                   for f, hs in holders.items()}


def _holders(every: list[dict], nodes: Nodes, step: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for node in range(nodes.count):
        files, _ = every[nodes.leader_of(node)].get(step, ([], b""))
        for f in files:
            out.setdefault(f, []).append(node)
    return out


def _missing(step: int, need: set[str], holders: dict[str, list[int]],
             reasons: list[str], why: str) -> bool:
    lost = sorted(f for f in need if not holders.get(f))
    if lost:
        reasons.append(f"local step {step}: {why} {', '.join(lost[:4])}"
                       f"{f' and {len(lost) - 4} more' if len(lost) > 4 else ''}")
    return bool(lost)


def _intact(held: Held | None, index: Index, files: set[str]) -> set[str]:
    """The ``files`` of ``held`` whose whole-file crc32c is the index's."""
    if held is None:
        return set()
    buf = bytearray(PIECE_BYTES)
    return {n for n, path in held.files.items()
            if n in files and index.file_checksums.get(n) is not None
            and file_crc(path, buf) == index.file_checksums[n]}


def restore_local(state_dict: dict[str, Any], choice: Choice, comm: Comm, local_dir: str, *,
                  options: LoadOptions, store_options: StoreOptions | None, strict: bool) -> RestoreResult:
    """Collective: fill ``state_dict`` from local step ``choice.step`` (see the module doc)."""
    t0 = time.perf_counter()
    assert choice.step is not None
    step, index, nodes = choice.step, Index.loads(choice.index), choice.nodes
    where = f"local step {step}"
    need = [set(n) for n in choice.need]
    read = set(choice.read)
    scratch = os.path.join(local_dir, SCRATCH_DIR, f"step-{step:08d}")
    fetched = comm.run_everywhere(
        f"restore: gathering the files of {where}",
        lambda: _gather(comm, nodes, choice, choice.mine.get(step), need, scratch, index))
    near = {f for f in read if nodes.mine in choice.holders.get(f, [])}
    own = LocalStore(scratch, local_options(store_options))
    peer = LocalStore(scratch, local_options(store_options))
    try:
        # files fetched from other nodes were checked whole as they arrived; with
        # ``choice.verified`` every file was (by its holder): their chunks need no second check
        verify = bool(near) and not choice.verified
        result = fill(state_dict, RoutedStore(own, peer, near), index, comm, where,
                      strict=strict, options=replace(options, verify=verify), started=t0)
    finally:
        if nodes.leader:
            shutil.rmtree(scratch, ignore_errors=True)
    return RestoreResult(step, result, tuple(sorted(near)), (), own.stats.bytes_read, 0, 0,
                         time.perf_counter() - t0, peer_files=tuple(sorted(read - near)),
                         peer_bytes=peer.stats.bytes_read, fetched_bytes=fetched or 0,
                         source="local", reason=_reason(step, choice.reasons))


def _reason(step: int, passed: tuple[str, ...]) -> str:
    head = f"local step {step}: the newest step every file of which a node holds intact"
    return "; ".join([head, *passed])


def _gather(comm: Comm, nodes: Nodes, choice: Choice, held: Held | None,
            need: list[set[str]], scratch: str, index: Index) -> int | None:
    """Leaders: link the files their node needs and holds into ``scratch``, and run every
    transfer of the others (ring-nearest holder to the node needing it); returns the bytes
    this node received."""
    if not nodes.leader:
        return None
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch, exist_ok=True)
    for f in sorted(need[nodes.mine]):
        if nodes.mine in choice.holders[f]:
            assert held is not None
            _link(held.files[f], os.path.join(scratch, f))
    buf, got, bad = bytearray(), 0, []  # allocated for the first transfer
    for dst in range(nodes.count):
        for f in sorted(need[dst]):
            src = nodes.nearest(dst, choice.holders[f])
            if src == dst or nodes.mine not in (src, dst):
                continue
            what = f"restore: fetching {f} from node {nodes.names[src]} to {nodes.names[dst]}"
            size = index.all_files[f]
            buf = buf or bytearray(PIECE_BYTES)
            if src == nodes.mine:
                assert held is not None
                send_file(comm, held.files[f], size, nodes.leader_of(dst), what, buf)
                continue
            crc = recv_file(comm, os.path.join(scratch, f), size, nodes.leader_of(src), what, buf)
            if crc != index.file_checksums.get(f):  # raised once every transfer is over
                bad.append(f"{what}: crc32c {crc}, the index records {index.file_checksums.get(f)}")
            got += size
    if bad:
        raise IntegrityError("; ".join(bad))
    return got


def _link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
