"""Nodes and the files that travel between them: which ranks form each node (its leader, the
lowest rank, moves its files), the nodes a node's local files are copied to (other failure
domains first), and files sent and received over torch.distributed in bounded pieces.

A failure domain (``$CKPTFS_FAILURE_DOMAIN`` or the manager's ``failure_domain=``: a rack, a
power feed, a switch) groups nodes that may fail together. A node's copies go to the nodes
after it in ring order, those of other domains first, one per domain in turn, then the rest of
other domains, then its own domain's; never the node itself. Without domains every node is a
domain of its own: the plain ring.

A transfer is a pair of node leaders; every rank walks the same list of transfers in the same
order and takes part only in its own, so the blocking sends and receives always pair up (the
earliest unfinished transfer has both sides ready). A transfer holds one buffer of
``PIECE_BYTES`` in two halves, never a whole file in memory: a piece travels from one half
while the other is read from disk (sender) or checksummed and written (receiver). A received
file's crc32c is computed as its pieces land and compared with what the sender's record says.

Pieces travel as tensors on the group's device (``Comm.device``): the host buffer itself over
gloo (a save's copies run on ckptfs's own gloo group), a device buffer of the same size the
pieces are copied through over a backend that takes only accelerator tensors (NCCL, when a
restore is called with such a group). Only the gloo path is tested.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ckptfs.dist import Comm
from ckptfs.dist.nodes import NodeLayout, node_id
from ckptfs.errors import ConfigError, IntegrityError
from ckptfs.layout.checksum import combine, crc_of, extend, render

#: the memory a transfer holds: two pieces of a file (one travelling, one read or written)
PIECE_BYTES = 16 * 2**20
DOMAIN_ENV = "CKPTFS_FAILURE_DOMAIN"  #: this process's failure domain ('' or unset: its node)


def failure_domain(given: str | None = None) -> str:
    """This process's failure domain: ``given``, else ``$CKPTFS_FAILURE_DOMAIN``, else ''."""
    if given is not None and not isinstance(given, str):
        raise ConfigError(f"CheckpointManager: failure_domain must be a str or None, got "
                          f"{given!r}")
    if given is not None:
        return given
    return os.environ.get(DOMAIN_ENV, "")


def replica_targets(node: int, domains: Sequence[str], replicas: int) -> list[int]:
    """The nodes that receive copies of ``node``'s files (``domains``: each node's failure
    domain, '' for a domain of its own): up to ``replicas`` nodes after ``node`` in ring order,
    other domains first, one per domain in turn, then the same domain; never ``node``."""
    count = len(domains)

    def key(n: int) -> str:
        return domains[n] or f"\0node {n}"  # unnamed: a domain of its own

    ring = [(node + k) % count for k in range(1, count)]
    by_domain: dict[str, list[int]] = {}
    for n in ring:
        if key(n) != key(node):
            by_domain.setdefault(key(n), []).append(n)
    spread = [n for turn in range(count) for held in by_domain.values()
              for n in held[turn:turn + 1]]
    same = [n for n in ring if key(n) == key(node)]
    return (spread + same)[:max(replicas, 0)]


@dataclass(frozen=True)
class Nodes:
    """The nodes of a group, in order of first appearance, and this rank's place among them."""

    names: tuple[str, ...]  #: each node's name ($CKPTFS_NODE_ID, the launcher's node rank, host)
    layout: NodeLayout
    rank: int  #: this rank (in the group)
    domains: tuple[str, ...] = ()  #: each node's failure domain ('': its own; () for none)

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def mine(self) -> int:
        """This rank's node."""
        return self.layout.node_of[self.rank]

    @property
    def leader(self) -> bool:
        """This rank moves its node's files (the lowest rank of the node)."""
        return self.layout.leader(self.rank) == self.rank

    def leader_of(self, node: int) -> int:
        return self.layout.ranks_on(node)[0]

    def targets(self, node: int, replicas: int) -> list[int]:
        """The nodes ``node``'s files are copied to (``replica_targets``)."""
        return replica_targets(node, self.domains or ("",) * self.count, replicas)

    def nearest(self, node: int, holders: list[int]) -> int:
        """Of ``holders``, the first after ``node`` in ring order (``node`` itself first)."""
        return min(holders, key=lambda h: (h - node) % self.count)


def nodes_of(comm: Comm, domain: str = "") -> Nodes:
    """Collective: every rank's node, and each node's failure domain (``domain``: this rank's;
    the ranks of a node must agree)."""
    pairs = comm.all_gather((node_id(), domain), "naming each rank's node")
    ids = [n for n, _ in pairs]
    names = tuple(dict.fromkeys(ids))
    domains: dict[str, str] = {}
    for (name, dom), rank in zip(pairs, range(len(pairs))):
        if domains.setdefault(name, dom) != dom:
            raise ConfigError(f"node {name}: its ranks name different failure domains "
                              f"({domains[name]!r}, {dom!r} on rank {rank}): ${DOMAIN_ENV} or "
                              f"failure_domain= must be the same on every rank of a node")
    return Nodes(names, NodeLayout.from_ids(ids), comm.rank, tuple(domains[n] for n in names))


def safe_name(node: str) -> str:
    """A node's name as a folder name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node) or "_"


def _wire(comm: Comm, size: int) -> torch.Tensor | None:
    """The device buffer pieces are copied through (None: the group takes host tensors)."""
    device = comm.device
    return None if device.type == "cpu" else torch.empty(size, dtype=torch.uint8, device=device)


def _send(comm: Comm, host: torch.Tensor, wire: torch.Tensor | None, peer: int, what: str) -> None:
    if wire is not None:
        wire = wire[:host.numel()]
        wire.copy_(host)
    comm.point_to_point([("send", host if wire is None else wire, peer, 0)], what)


def _recv(comm: Comm, host: torch.Tensor, wire: torch.Tensor | None, peer: int, what: str) -> None:
    comm.point_to_point([("recv", host if wire is None else wire[:host.numel()], peer, 0)], what)
    if wire is not None:
        host.copy_(wire[:host.numel()])


def send_bytes(comm: Comm, data: bytes, peer: int, what: str) -> None:
    wire = _wire(comm, 8)
    _send(comm, torch.tensor([len(data)], dtype=torch.int64),
          None if wire is None else wire.view(torch.int64), peer, what)
    if data:
        _send(comm, torch.frombuffer(bytearray(data), dtype=torch.uint8), _wire(comm, len(data)),
              peer, what)


def recv_bytes(comm: Comm, peer: int, what: str) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    wire = _wire(comm, 8)
    _recv(comm, n, None if wire is None else wire.view(torch.int64), peer, what)
    buf = bytearray(int(n.item()))
    if buf:
        _recv(comm, torch.frombuffer(buf, dtype=torch.uint8), _wire(comm, len(buf)), peer, what)
    return bytes(buf)


def send_file(comm: Comm, path: str, size: int, peer: int, what: str, buf: bytearray) -> None:
    """Send ``size`` bytes of ``path`` to ``peer`` in pieces of half ``len(buf)``, the next
    piece read (a worker thread) while the last one travels."""
    half = len(buf) // 2
    wire = _wire(comm, half)
    with open(path, "rb") as f, ThreadPoolExecutor(1) as worker:
        def read(at: int, n: int) -> int:
            return f.readinto(memoryview(buf)[at:at + n]) if n else 0

        at, left = 0, size
        ahead = worker.submit(read, at, min(left, half))
        while left:
            n = ahead.result()
            if not n:
                raise IntegrityError(f"{path}: shorter than the {size} bytes its record names")
            left -= n
            ahead = worker.submit(read, half - at, min(left, half))
            _send(comm, torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=at), wire,
                  peer, what)
            at = half - at


def recv_file(comm: Comm, path: str, size: int, peer: int, what: str, buf: bytearray) -> str:
    """Receive ``size`` bytes from ``peer`` into ``path`` in pieces of half ``len(buf)``, each
    checksummed and written (a worker thread) while the next one arrives; returns their
    crc32c."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    half = len(buf) // 2
    wire = _wire(comm, half)
    crc = 0
    with open(path, "wb") as f, ThreadPoolExecutor(1) as worker:
        def land(at: int, n: int) -> None:
            nonlocal crc
            piece = memoryview(buf)[at:at + n]
            crc = combine(crc, crc_of(piece), n)  # without the GIL (layout/checksum.py)
            f.write(piece)

        at, left = 0, size
        landing: Future[None] | None = None
        while left:
            n = min(left, half)
            _recv(comm, torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=at), wire,
                  peer, what)
            if landing is not None:
                landing.result()  # the other half is free again
            landing = worker.submit(land, at, n)
            left -= n
            at = half - at
        if landing is not None:
            landing.result()
    return render(crc)


def file_crc(path: str, buf: bytearray) -> str:
    """The crc32c of the file at ``path``, read in pieces of ``len(buf)``."""
    crc = 0
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = extend(crc, memoryview(buf)[:n])
    return render(crc)


def send_record(comm: Comm, record: Mapping, folder: str, peer: int, what: str) -> None:
    """Send a copy's record, then each file it names (from ``folder``), to ``peer``."""
    send_bytes(comm, json.dumps(record).encode(), peer, what)
    buf = bytearray(PIECE_BYTES)
    for name, (size, _) in sorted(record["files"].items()):
        send_file(comm, os.path.join(folder, name), size, peer, f"{what}: {name}", buf)


def recv_record(comm: Comm, folder: str, peer: int, what: str) -> tuple[dict, set[str]]:
    """Receive ``send_record``'s record and files into ``folder``: (the record, the files that
    arrived with the crc32c it names)."""
    record = json.loads(recv_bytes(comm, peer, what))
    buf = bytearray(PIECE_BYTES)
    good = set()
    for name, (size, crc) in sorted(record["files"].items()):
        if recv_file(comm, os.path.join(folder, name), size, peer, f"{what}: {name}", buf) == crc:
            good.add(name)
    return record, good
