"""``ckptfs.load`` (in place, resharding) and ``ckptfs.load_keys`` (whole tensors, no targets)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index, read_root, read_rows
from ckptfs.engine.load import exchange as xchg
from ckptfs.engine.load.run import read_tensors
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.engine.load.targets import (
    TargetPlan,
    check_allocation,
    files_of,
    plan_targets,
    referenced_files,
    wanted_boxes,
)
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import MissingKeysError
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.io.progress_store import load_progress
from ckptfs.layout.boxes import full_box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import Index
from ckptfs.layout.keys import encode_key
from ckptfs.layout.values import decode_value
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.planning.load_plan import plan_reads
from ckptfs.state.flatten import set_path, unflatten

if TYPE_CHECKING:
    from ckptfs.engine.load.pre_download import CachedIndex


@dataclass(frozen=True)
class LoadResult:
    """What one rank's load found and moved."""

    missing_keys: list[str] = field(default_factory=list)  #: in the target, not the checkpoint
    unexpected_keys: list[str] = field(default_factory=list)  #: in the checkpoint, not the target
    bytes_read: int = 0  #: data bytes fetched from storage by this rank (index excluded)
    bytes_needed: int = 0  #: bytes of the tensor regions this rank had to fill
    read_requests: int = 0
    seconds: float = 0.0
    scratch_peak: int = 0  #: most scratch memory (bytes) held at once for non-contiguous targets
    exchanged_bytes: int = 0  #: bytes received from other ranks (``exchange``) instead of read


def _remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


@moved_keywords("load", REMOVED["load"])
def load(state_dict: dict[str, Any], url: str | os.PathLike, *,
         process_group: ProcessGroup | None = None,
         storage_options: Mapping[str, Any] | None = None,
         store_options: StoreOptions | None = None, strict: bool = True,
         progress: bool = False, options: LoadOptions | None = None) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``, resharding as needed.

    Tensors (and DTensor local shards) are filled with exactly the byte ranges they overlap;
    plain values are replaced. With ``strict`` a target key missing from the checkpoint raises
    MissingKeysError naming it. ``options`` (``LoadOptions``) tune the load: ``verify`` checks
    crc32c of every chunk read; ``pre_download`` first copies the files each node needs into
    the node-local ``work_dir``; ``exchange`` reads each region several ranks need once per
    process group and sends it to the others (default: when the checkpoint is remote and the
    group has more than one rank); ``dist.collective_timeout`` bounds every wait for the other
    ranks, as in ``save``. ``store_options`` (``StoreOptions``) tune the store. ``progress``:
    rank 0 shows the bytes it reads (a bar on a terminal; one summary line in a log).
    """
    t0 = time.perf_counter()
    url = os.fspath(url)
    opts = options or LoadOptions()
    with public_errors(url):
        comm = Comm(process_group, timeout=opts.collective_timeout)
        store = run_sync(open_store(url, storage_options, store_options))
        exchange = opts.exchange
        if exchange is None:
            exchange = comm.size > 1 and _remote(url)
        try:
            cached = None
            if opts.pre_download:
                from ckptfs.engine.load.pre_download import cached_index

                cached = cached_index(comm, store, url, opts.work_dir)
                index = cached.index
            else:
                # a segmented index's root only: each rank reads the rows it needs (fill)
                index = comm.run_on_coordinator(f"load: reading the index of {url}",
                                                lambda: run_sync(read_root(store)))

            source, bar = load_progress(store, progress and comm.is_coordinator,
                                        f"ckptfs load {url}")
            try:
                result = fill(state_dict, source, index, comm, url, strict=strict, options=opts,
                              started=t0, exchange=exchange, cached=cached)
            except BaseException:
                bar.close(done=False)
                raise
            bar.close()
            return result
        finally:
            run_sync(store.close())


def fill(state_dict: dict[str, Any], store: Store, index: Index, comm: Comm, url: str, *,
         strict: bool, options: LoadOptions, started: float, exchange: bool = False,
         cached: CachedIndex | None = None) -> LoadResult:
    """Collective: fill ``state_dict`` from the checkpoint ``index`` describes, reading through
    ``store`` (load's second half; the manager's restore reads through a routed store).
    ``exchange``: read each replicated region once and send it to the others; ``cached``: the
    pre-download cache, filled with the files this rank's reads touch and then read from.
    A segmented ``index`` (a root) gets the rows of the blocks this rank's targets overlap,
    read by this rank alone (``read_rows``), before it plans."""
    if index.segmented:
        root = index
        index = comm.run_everywhere(f"load from {url}: reading the index rows", lambda: run_sync(
            read_rows(store, root, wanted_boxes(state_dict, root, comm.rank))))

    def match() -> TargetPlan:
        plan = plan_targets(state_dict, index, comm.rank)
        if strict and plan.missing:
            raise MissingKeysError(url, list(plan.missing))
        return plan

    plan = comm.run_everywhere(f"load from {url}: matching the target", match)
    reads = plan.reads
    ex = None
    if exchange:
        ex = xchg.plan_load(comm, plan.reads, options.exchange_bytes)
        reads = ex.reads
    source = store
    if cached is not None:  # a delta's referenced files too, each into its base's cache
        from ckptfs.engine.load.pre_download import fill_cache

        source = fill_cache(comm, store, cached, files_of(reads), referenced_files(reads))
    try:
        def read() -> tuple[int, int]:
            return run_sync(read_tensors(source, index, reads, options))

        before = (source.stats.bytes_read, source.stats.read_requests)
        _, peak = comm.run_everywhere(f"load from {url}", read)
        got = comm.run_everywhere(f"load from {url}: exchanging", lambda: xchg.run(comm, ex)) if ex else 0
        for path, value in plan.replace:
            set_path(state_dict, path, value)
        st = source.stats
        needed = sum(p.src.volume * from_name(r.entry.dtype).itemsize
                     for r in plan.reads for p in r.pieces)
        return LoadResult(list(plan.missing), list(plan.unexpected),
                          st.bytes_read - before[0], needed, st.read_requests - before[1],
                          time.perf_counter() - started, peak, got)
    finally:
        if source is not store:
            run_sync(source.close())


@moved_keywords("load_keys", REMOVED["load"])
def load_keys(url: str | os.PathLike, keys: Iterable[str | tuple] | None = None, *,
              storage_options: Mapping[str, Any] | None = None,
              store_options: StoreOptions | None = None,
              options: LoadOptions | None = None) -> dict[str, Any]:
    """Whole (unsharded) tensors and values of the checkpoint, as the nested state dict that was
    saved, with its exact types (int keys, tuples, lists). ``keys`` selects leaves or subtrees
    by canonical key ("optim/state/0") or path tuple; None loads everything. Runs in one process.
    """
    opts = options or LoadOptions()

    async def go() -> dict[str, Any]:
        store = await open_store(url, storage_options, store_options)
        try:
            index = await read_index(store)
            chosen, prefixes = _select(index, keys, os.fspath(url))
            leaves: dict[str, Any] = {}
            jobs = []
            check_allocation([index.tensors[k] for k in chosen if k in index.tensors])
            for k in chosen:
                if k in index.tensors:
                    e = index.tensors[k]
                    t = torch.empty(e.shape, dtype=from_name(e.dtype, k).torch)
                    leaves[k] = t
                    if t.numel():
                        jobs.append(TensorRead(e, t, tuple(plan_reads(e, full_box(e.shape)))))
                else:
                    leaves[k] = decode_value(index.values[k], k)
            await read_tensors(store, index, jobs, opts)
            conts = {k: v for k, v in index.containers.items()
                     if prefixes is None or any(_related(k, p) for p in prefixes)}
            return unflatten(conts, leaves, index.order)
        finally:
            await store.close()

    with public_errors(os.fspath(url)):
        return run_sync(go())


def _related(a: str, b: str) -> bool:
    """a is b, an ancestor of b, or inside b."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _select(index: Index, keys: Iterable[str | tuple] | None,
            url: str) -> tuple[list[str], list[str] | None]:
    every = [*index.tensors, *index.values]
    if keys is None:
        return every, None
    out: list[str] = []
    prefixes: list[str] = []
    for k in keys:
        key = encode_key(tuple(k)) if isinstance(k, tuple) else k
        hits = [x for x in every if x == key or x.startswith(key + "/")]
        if not hits and key not in index.containers:
            raise MissingKeysError(url, [key])
        prefixes.append(key)
        out.extend(h for h in hits if h not in out)
    return out, prefixes
