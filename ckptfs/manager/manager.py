"""``ckptfs.CheckpointManager``: the training loop's checkpointer. Numbered steps under one URL,
retention, a ``latest_step`` that only names committed checkpoints, an optional node-local tier
written first and persisted in the background, preemption saves agreed across ranks, and a
restore that reshards like ``load`` and reads intact local copies first.

A save is the engine's save pipeline (engine/save/pipeline.py, as ``async_save`` runs it: stage ->
claim -> write -> commit on the background group, one save in flight per process) with a
``SaveRequest`` of the step's folder (written through the local tier where there is one), then,
in the same background job, once the step is committed, retention (manager/steps.py); a local
step's request writes the node's tier and its copies go to other nodes after
(manager/replicas.py).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

from ckptfs.async_save import AsyncSave
from ckptfs.deletion import delete_checkpoint
from ckptfs.dist import Comm, ProcessGroup
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.engine.background.writer_process import new_saver
from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.engine.save.commit import claimed
from ckptfs.engine.save.delta import RAW_BACKEND
from ckptfs.engine.save.hash_memo import HashMemo
from ckptfs.engine.save.hooks import SaveHook
from ckptfs.engine.save.lock import read_lock
from ckptfs.engine.save.pipeline import SaveRequest, clear_dead, local_options
from ckptfs.errors import CheckpointNotFoundError, CkptfsError, CollectiveError, ConfigError
from ckptfs.io import Store, open_store, run_sync
from ckptfs.io.prefixed import PrefixedStore
from ckptfs.layout.index import LOCK_FILE, Index
from ckptfs.manager.health import LAST_GOOD, last_good
from ckptfs.manager.options import MOVED, ManagerOptions
from ckptfs.manager.peers import Nodes
from ckptfs.manager.peers import failure_domain as failure_domain_of
from ckptfs.manager.preemption import Preemption
from ckptfs.manager.promote import promote
from ckptfs.manager.recover import Choice, choose, restore_local
from ckptfs.manager.replicas import clear_local, drop_local, read_record, share_local
from ckptfs.manager.steps import Listing, parse_step, read_listing, referenced_steps, step_dir
from ckptfs.manager.tier import RestoreResult, restore_tiered
from ckptfs.options import moved_keywords
from ckptfs.save import SaveResult, delta_hooks, health_hooks, make_backend

log = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints of one training run at ``url/step-<N>/`` (see the documentation's
    "The checkpoint manager"). Every rank of ``process_group`` creates it with the same arguments, in the same
    order as its other managers, and calls ``save``/``save_sync``/``restore``/``should_save``
    together; ``steps``, ``latest_step`` and ``metadata`` read storage and may be called by any
    rank alone.

    ``options`` (``ManagerOptions``, manager/options.py) group what it is told:

    - ``retention=Retention(keep_last=K, keep_every=N)`` keeps the K newest committed steps
      (None: all) and every step divisible by N. Older steps are deleted (index first) by the
      save that committed a newer one, never the newest committed one or one being written.
    - ``tiers=TierOptions(local_dir=...)`` (node-local disk or ``/dev/shm``): each rank's files
      are written there first, then copied to ``url`` in the background; ``restore`` reads the
      local copies that match the committed index and fetches the rest from ``url``. Ranks of a
      node may share it.
    - ``save_interval_steps=N``: ``should_save(step)`` is True when N divides ``step``.
    - ``tiers=TierOptions(local_interval_steps=N)`` (with ``local_dir``): ``should_save`` is
      also True when N divides ``step``, and ``save`` of such a step (not one of
      ``save_interval_steps``) is a local step: written to the nodes' local tiers only, each
      node's files copied to ``replicas`` other nodes in the background, nodes of other failure
      domains first (``failure_domain``, else ``$CKPTFS_FAILURE_DOMAIN``: a rack, a power
      feed); the newest ``keep_local`` are kept (docs/guide/recovery-tiers.md). ``restore``
      picks the newest step it can restore intact from the local tiers of the nodes present or
      from the URL.
    - ``preemption=PreemptionPolicy(...)``: the signals whose notice triggers a save agreed by
      every rank (default SIGTERM, SIGUSR1), and whether the ranks exit after it.
    - ``save`` / ``load`` / ``store`` (``SaveOptions``, ``LoadOptions``, ``StoreOptions``) tune
      its saves, restores and store as they tune ``save`` and ``load``;
      ``save.asynchronous.writer``: the kind of its saver, ``"thread"`` or ``"process"``
      (``ckptfs.async_save``'s ``writer``); ``save.health``: ``check_finite`` / ``stats`` as
      for ``ckptfs.save``: a step holding NaN or infinity is not committed and the previous one
      stays the latest (docs/health.md).
    - ``progress``: rank 0 shows the bytes each save writes and each restore reads (a bar on a
      terminal, one summary line in a log).

    ``saver``: the ``BackgroundSaver`` its saves run on (default: one of its own of
    ``save.asynchronous.writer``'s kind, closed with it). A keyword it took before
    ``ManagerOptions`` is refused with ``TypeError`` naming where it lives now.
    """

    @moved_keywords("CheckpointManager", MOVED)
    def __init__(self, url: str | os.PathLike, options: ManagerOptions | None = None, *,
                 backend: str = "safetensors_chunks", backend_version: int | None = None,
                 backend_options: Mapping[str, Any] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: ProcessGroup | None = None,
                 saver: BackgroundSaver | None = None) -> None:
        self.url = os.fspath(url).rstrip("/")
        self.options = opts = options if options is not None else ManagerOptions()
        if not isinstance(opts, ManagerOptions):
            raise ConfigError(f"CheckpointManager: options must be a ckptfs.ManagerOptions, got "
                              f"{opts!r}")
        tiers = opts.tiers
        self.local_dir = os.path.abspath(tiers.local_dir) if tiers.local_dir is not None else None
        self.local_interval_steps = tiers.local_interval_steps
        self.replicas, self.keep_local = tiers.replicas, tiers.keep_local
        #: this rank's failure domain (manager/peers.py): local steps' copies go to others first
        self.failure_domain = failure_domain_of(tiers.failure_domain)
        self.retention, self.preemption = opts.retention, opts.preemption
        self.save_interval_steps = opts.save_interval_steps
        self.storage_options = storage_options
        self.process_group = process_group
        self.save_options, self.store_options = opts.save, opts.store
        self.load_options = opts.load_options
        #: runs this manager's saves (its own, on a lane named by the URL, unless one is given)
        self.saver = saver or new_saver(opts.save.writer, f"background:{self.url}")
        self._owns_saver = saver is None
        self.progress = opts.progress  #: rank 0 shows the bytes its saves write and restores read
        with public_errors(self.url):
            Comm(process_group)  # refuses a group without torch.distributed
            self._backend = make_backend(backend, backend_version, backend_options)
        if opts.save.delta and (self._backend.name, self._backend.version) != RAW_BACKEND:
            raise ConfigError(f"CheckpointManager({self.url!r}): SaveOptions(delta=True) needs "
                              f"backend {RAW_BACKEND[0]}-{RAW_BACKEND[1]} (a reference names a "
                              f"raw byte range), not {self._backend.name}-{self._backend.version}")
        policy = self.preemption
        self._preemption = (Preemption(policy.signals, process_group, policy.timeout)
                            if policy.signals else None)
        self._preempt_step: int | None = None
        self._last: AsyncSave | None = None
        #: step folder -> the base URLs its index names (``_unreferenced``)
        self._bases: dict[str, tuple[str, ...]] = {}
        #: ``SaveOptions(reuse_hashes=True)``: its steps' hashes of unchanged tensors
        self._memo = HashMemo()
        self._store: Store | None = None  # the URL's store, opened once, shared by every step
        self._store_lock = threading.Lock()
        self.last_restore: RestoreResult | None = None  #: what this rank's last restore read
        self.preempted = False  #: the preemption save is committed (PreemptionPolicy(exit=False))

    # -- where things are ------------------------------------------------------------------
    def _url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _local(self, name: str) -> str | None:
        return None if self.local_dir is None else os.path.join(self.local_dir, name)

    def _root(self) -> Store:
        """The URL's store, opened on first use and kept until ``close()`` (one client and
        connection pool for every step folder)."""
        with self._store_lock:
            if self._store is None:
                self._store = run_sync(open_store(self.url, self.storage_options, self.store_options,
                                                  nice=self.save_options.background_nice))
            return self._store

    def _open_agreed(self, comm: Comm, what: str) -> Store:
        """``_root()`` on every rank of ``comm``; a rank that cannot open it fails all."""
        comm.run_everywhere(what, lambda: self._root() and None)
        return self._root()

    def _at(self, name: str) -> PrefixedStore:
        return PrefixedStore(self._root(), name)

    def _listing(self) -> Listing:
        with public_errors(self.url):
            return read_listing(run_sync(self._root().list()))

    # -- what is there ---------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps (those with an index at the URL), ascending."""
        return list(self._listing().committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None. With a local tier a step counts only once it is
        committed at the URL: never ahead of durability."""
        committed = self._listing().committed
        return committed[-1] if committed else None

    def metadata(self, step: int | None = None) -> Index:
        """The index of ``step`` (default: the latest committed step); reads no tensor data."""
        listing = self._listing()
        step = self._committed(listing, step)
        with public_errors(self.url):
            return run_sync(read_index(self._at(listing.dirs[step])))

    def last_good_step(self) -> int | None:
        """The newest committed step whose index reads and verifies its own checksum and whose
        fingerprints (``stats=True``) count no NaN or infinity; None when there is none
        (manager/health.py). Reads indexes only, newest first."""
        listing = self._listing()
        return last_good(listing.committed,
                         lambda s: run_sync(read_index(self._at(listing.dirs[s]))))

    def _committed(self, listing: Listing, step: int | None) -> int:
        if step is None:
            if not listing.committed:
                raise CheckpointNotFoundError(f"{self.url}: no committed step")
            return listing.committed[-1]
        if step not in listing.committed:
            raise CheckpointNotFoundError(
                f"{self._url(step_dir(step))}: step {step} is not committed (committed steps: "
                f"{list(listing.committed)[-10:]})")
        return step

    # -- saving ----------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Call once per step on every rank: True at the save interval, or at the step every
        rank agreed on after a preemption notice on any rank (one store round trip per call
        while no notice is known; no collective)."""
        if self._preemption is not None and self._preemption.reached():
            self._preempt_step = step
            return True
        return any(n is not None and step % n == 0
                   for n in (self.save_interval_steps, self.local_interval_steps))

    def is_local_step(self, step: int) -> bool:
        """Whether ``save(step)`` writes a local step (see the class doc) rather than one at
        the URL: a local interval step that is not a persistent one nor the preemption step."""
        n, m = self.local_interval_steps, self.save_interval_steps
        return (n is not None and step % n == 0 and not (m is not None and step % m == 0)
                and step != self._preempt_step)

    def save(self, step: int, state_dict: Mapping[str, Any], *, force: bool = False) -> AsyncSave:
        """Start saving ``state_dict`` as ``step``; returns once this rank's bytes are staged
        (``staged`` has resolved: unlike ``ckptfs.async_save``, the call waits for it, so the
        loop may change its tensors as soon as it returns; a staging failure is kept on the
        handle, ``done`` and the next ``wait()`` raise it), and ``done`` resolves once the step is
        committed at the URL and retention has run. A step already committed is refused
        (CheckpointExistsError on ``done``) unless ``force`` (then it is replaced). Waits first
        for this process's save in flight. The preemption step's save is synchronous."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        started = time.perf_counter()
        name = step_dir(step)
        url, local = self._url(name), self._local(name)
        with public_errors(url):
            Comm(self.process_group)
        self._bases.pop(name, None)  # a replaced step may name other bases

        preempt = self._preempt_step is not None and step == self._preempt_step
        restorable: Future[SaveResult] = Future()
        local_step = self.is_local_step(step)
        if (preempt and self.local_interval_steps is not None) or local_step:
            # a local step (the preemption's: the fastest restorable tier)
            request, nodes = self._local_request(step, started), _Box()
            before = functools.partial(_before_local, self, step, nodes)
            after: Callable[[SaveResult, Comm], SaveResult] = (
                functools.partial(_after_preempt_step, self, step, name, started, nodes,
                                  restorable)
                if not local_step else functools.partial(_after_local, self, step, nodes))
        else:
            request = self._request(name, local, force, started, self._delta_base(step))
            before, after = None, self._retained
        staged, done = self.saver.start(state_dict, request, process_group=self.process_group,
                                        before=before, after=after)
        staged.exception()  # the caller's tensors are free again once staged (never raises)
        handle = AsyncSave(local if local_step and local else url, staged, done)
        self._last = handle
        if preempt:
            wait([restorable, done], return_when=FIRST_COMPLETED)
            (restorable if restorable.done() else done).result()
            self._preempted()
        return handle

    def _request(self, name: str, local: str | None, force: bool, started: float,
                 base: str | None = None) -> SaveRequest:
        """The pipeline's request of a step's save at the URL: its folder claimed, a dead
        save's files cleared, written through the local tier if any, committed (``base``: the
        step it is a delta on, ``_delta_base``)."""
        opts = self.save_options
        return SaveRequest(self.url, self._backend, self.storage_options, self.store_options,
                           opts, force, self.progress and local is None,
                           self._hooks(self._url(name), base),
                           folder=name, clear_dead=True, local_root=local,
                           nice=opts.background_nice, started=started, opener=self._root)

    def _local_request(self, step: int, started: float) -> SaveRequest:
        """The pipeline's request of a local step's save into this node's tier (no lock: the
        folder is this save's, emptied first by ``_before_local``)."""
        assert self.local_dir is not None
        root = os.path.join(self.local_dir, step_dir(step))
        return SaveRequest(root, self._backend, None, local_options(self.store_options),
                           self.save_options, hooks=self._hooks(root), claim=False,
                           started=started)

    def _hooks(self, url: str, base: str | None = None) -> tuple[SaveHook, ...]:
        """The save hooks of a step at ``url``; with ``SaveOptions(delta=True)`` the step
        records hashes and, given a ``base``, is a delta on it (a local step gets none: it
        references nothing, docs/guide/delta.md)."""
        opts = self.save_options
        if opts.delta:
            opts = replace(opts, delta=False, hashes=True, base=base)
        return health_hooks(opts) + delta_hooks(opts, url, self._backend, self.storage_options,
                                                self._memo)

    def _delta_base(self, step: int) -> str | None:
        """With ``SaveOptions(delta=True)``: the URL of the newest step committed at the URL
        before ``step`` (None: none, one of another backend, or delta off), as the coordinator
        lists it once this manager's save in flight is done (collective over
        ``process_group``). Retention keeps it while a kept step references it
        (``_unreferenced``)."""
        if not self.save_options.delta:
            return None
        if self._last is not None:
            self._last.done.exception()  # the step before is committed (or failed) first

        def newest() -> str | None:
            listing = self._listing()
            earlier = [s for s in listing.committed if s < step]
            if not earlier:
                return None
            name = listing.dirs[earlier[-1]]
            index = run_sync(read_index(self._at(name)))
            self._bases.setdefault(name, index.bases)
            # a step of another layout (saved before the backend changed) is no base: whole
            return self._url(name) if (index.backend, index.backend_version) == RAW_BACKEND else None

        with public_errors(self.url):
            comm = Comm(self.process_group, timeout=self.save_options.collective_timeout)
            return comm.run_on_coordinator(f"save: choosing the base of step {step} at "
                                           f"{self.url}", newest)

    def _retained(self, result: SaveResult, comm: Comm) -> SaveResult:
        """After a step's commit: retention (``_retain``)."""
        self._retain(comm)
        return result

    def save_sync(self, step: int, state_dict: Mapping[str, Any], *,
                  force: bool = False) -> SaveResult:
        """``save`` and wait until the step is committed."""
        return self.save(step, state_dict, force=force).result()

    def _preempted(self) -> None:
        self.preempted = True
        assert self._preemption is not None
        signum = self._preemption.signum
        if self.preemption.exit:
            self.close()
            raise SystemExit(128 + signum)

    def _unreferenced(self, listing: Listing, drop: list[int]) -> list[int]:
        """``drop`` but the steps a kept step references (delta checkpoints, formats/README.md
        §2.5): a step is deleted only when no kept step needs its files. Each kept step's
        ``bases`` are read from its index once (an index never changes once committed)."""
        if not drop:
            return drop
        kept = [s for s in listing.committed if s not in drop]

        def bases_of(step: int) -> tuple[str, ...]:
            name = listing.dirs[step]
            if name not in self._bases:
                self._bases[name] = run_sync(read_index(self._at(name))).bases
            return self._bases[name]

        needed = referenced_steps(kept, listing.dirs, self.url, bases_of)
        return [s for s in drop if s not in needed]

    def _retain(self, comm: Comm) -> None:
        """After a commit (collective over ``comm``): delete what retention lets go and dead
        saves' leftovers older than the newest committed step, never one whose lock is still
        renewed (coordinator, index first via ``ckptfs.delete``'s order), then prune every
        rank's local tier to the committed steps kept. A failure here is logged; the step is
        committed either way."""
        def coordinator() -> list[int]:
            listing = self._listing()
            drop = self._unreferenced(listing, self.retention.to_delete(listing.committed))
            latest = listing.committed[-1] if listing.committed else -1
            dead = [s for s in sorted(listing.present)
                    if s not in listing.committed and s < latest and not _saving(self._at(listing.dirs[s]))]
            for s in [*drop, *dead]:
                run_sync(delete_checkpoint(self._at(listing.dirs[s]), missing_ok=True))
            _drop_stale_locks(self, listing, set(listing.committed) - set(drop))
            return sorted(set(listing.committed) - set(drop))

        try:
            kept = set(comm.run_on_coordinator(f"retention at {self.url}", coordinator))
        except CkptfsError as e:
            log.warning("ckptfs: retention at %s failed (retried after the next save): %s",
                        self.url, e)
            return
        if self.local_dir is not None and os.path.isdir(self.local_dir):
            newest = max(kept, default=-1)
            for name in os.listdir(self.local_dir):
                s = parse_step(name)
                if s is not None and s not in kept and not (
                        s > newest and read_record(os.path.join(self.local_dir, name))):
                    shutil.rmtree(os.path.join(self.local_dir, name), ignore_errors=True)
            # made redundant by the URL's (a preemption's local step, persisted too, stays)
            drop_local(self.local_dir, lambda s: s < newest)

    # -- restoring -------------------------------------------------------------------------
    def restore(self, state_dict: dict[str, Any], step: int | str | None = None, *,
                strict: bool = True) -> int | None:
        """Fill ``state_dict`` in place from ``step`` (default: the latest committed step),
        resharding to this world and layout like ``ckptfs.load``; returns the step restored,
        or None when no step is committed (and ``step`` was not given). With a local tier each
        data file is read once from its local copy when that copy matches the committed index
        (its size, and the crc32c of every chunk read, checked as it lands), from the URL
        otherwise (``last_restore`` says which; manager/tier.py). With local steps (see the
        class doc) the default is the newest step restorable intact from the nodes' local
        tiers or the URL, whichever is newer (manager/recover.py; ``last_restore.reason`` says
        why). ``step="last_good"`` restores ``last_good_step()`` (as rank 0 finds it).
        Collective over ``process_group``."""
        if self._last is not None:
            self._last.done.exception()  # restore sees every save this manager started
        with public_errors(self.url):
            comm = Comm(self.process_group)
            store = self._open_agreed(comm, f"restore: opening {self.url}")
            found = comm.run_on_coordinator(f"restore: listing the steps at {self.url}", self._listing)
            if step == LAST_GOOD:
                step = comm.run_on_coordinator(f"restore: finding the last good step at {self.url}",
                                               self._last_good)
            if isinstance(step, str):
                raise ConfigError(f"CheckpointManager.restore: step must be an int, None or "
                                  f"{LAST_GOOD!r}, got {step!r}")
            choice = self._local_choice(comm, found, step, state_dict, strict)
            if choice is not None and choice.step is not None:
                local, choice = self._restore_local(state_dict, comm, found, step, choice, strict)
                if local is not None:
                    self.last_restore = local
                    self._leave_newer(local.step, resumed=step is None)
                    return local.step
            if step is None and not found.committed:
                return None
            self.last_restore = self._restore_persistent(state_dict, comm, store, found, step,
                                                         choice, strict)
            self._leave_newer(self.last_restore.step, resumed=choice is not None and step is None)
            return self.last_restore.step

    def _restore_persistent(self, state_dict: dict[str, Any], comm: Comm, store: Store,
                            found: Listing, asked: int | None, choice: Choice | None,
                            strict: bool) -> RestoreResult:
        """Collective: restore a step committed at the URL (through the local tier's copies)."""
        step = self._committed(found, asked)
        name = found.dirs[step]
        result = restore_tiered(
            state_dict, step, PrefixedStore(store, name), self._url(name), self._local(name),
            comm, options=self.load_options, store_options=self.store_options, strict=strict,
            progress=self.progress)
        reasons = choice.reasons if choice is not None else ()
        why = "asked for" if asked is not None else "the newest committed at the URL"
        more = " and no newer local step is restorable" if reasons else ""
        return replace(result, reason="; ".join([f"persistent step {step}: {why}{more}", *reasons]))

    def _restore_local(self, state_dict: dict[str, Any], comm: Comm, found: Listing,
                       step: int | None, choice: Choice, strict: bool
                       ) -> tuple[RestoreResult | None, Choice]:
        """Collective: restore ``choice``'s local step, its copies checked as they are read; if
        a check (or any read) fails, choose again with every copy checked whole first and
        restore that choice (None: no local step is restorable; the returned choice says why).
        A failure that the full check does not explain is raised."""
        def run(c: Choice) -> RestoreResult:
            return restore_local(state_dict, c, comm, self.local_dir or "",
                                 options=self.load_options, store_options=self.store_options,
                                 strict=strict)

        try:
            return run(choice), choice
        except CollectiveError:
            raise
        except Exception as e:  # every rank gets here: its own error or a RankError
            if choice.verified:
                raise
            log.warning("ckptfs: restoring local step %s failed (%s); checking every copy",
                        choice.step, e)
            again = self._local_choice(comm, found, step, state_dict, strict, verify=True)
            assert again is not None
            if again.step == choice.step and again.holders == choice.holders:
                raise
            return (run(again) if again.step is not None else None), again

    def _local_choice(self, comm: Comm, found: Listing, step: int | None,
                      state_dict: dict[str, Any], strict: bool,
                      verify: bool = False) -> Choice | None:
        """Collective: the local step to restore (None: no local tier, or ``step`` is a
        committed one), with the reasons newer local steps were passed (``verify``: every copy
        to be read checked whole first, recover.py)."""
        if self.local_dir is None or (step is not None and step in found.committed):
            return None
        latest = found.committed[-1] if found.committed else None
        choice = choose(comm, self.local_dir, latest, state_dict, only=step, strict=strict,
                        verify=verify)
        if step is not None and choice.step is None:
            raise CheckpointNotFoundError(
                f"{self._url(step_dir(step))}: step {step} is neither committed nor restorable "
                f"from the local tiers ({'; '.join(choice.reasons) or 'no node holds it'})")
        return choice

    def _leave_newer(self, step: int, *, resumed: bool) -> None:
        """After resuming at ``step``: the local steps after it belong to a timeline the run
        leaves (a later crash must not pick them); an explicit step's restore keeps them."""
        if resumed and self.local_dir is not None:
            drop_local(self.local_dir, lambda s: s > step)

    def _last_good(self) -> int:
        step = self.last_good_step()
        if step is None:
            raise CheckpointNotFoundError(f"{self.url}: no committed step is good (an index "
                                          f"that verifies, with finite fingerprints)")
        return step

    # -- lifecycle -------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait until this manager's latest save is committed; raises its failure."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Wait for the save in flight (its failure stays on its handle; ``wait()`` raises it),
        put the previous signal handlers back and free the staging buffers and background
        groups (``ckptfs.close()``)."""
        if self._last is not None:
            self._last.done.exception()
        if self._preemption is not None:
            self._preemption.uninstall()
        if self._owns_saver:
            self.saver.close()
        with self._store_lock:
            store, self._store = self._store, None
        if store is not None:
            run_sync(store.close())

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_stale_locks(manager: CheckpointManager, listing: Listing, kept: set[int]) -> None:
    """The lock a save killed between its commit and its release left in a kept step: the
    step is complete, the lock only debris that ``verify`` would report for ever. Removed
    unless a save still renews it (a replacing save of that step now running)."""
    for s in sorted(listing.locked & kept):
        store = manager._at(listing.dirs[s])
        if not _saving(store):
            run_sync(store.delete([LOCK_FILE]))


def _saving(store: Store) -> bool:
    """A save may be running in this step folder: its lock is there and still renewed (or
    unreadable), as ``ckptfs clean`` judges it; a killed save's stale lock does not count."""
    held = run_sync(read_lock(store))
    return held is None or (held is not False and not held.stale())


class _Box:
    """The nodes of a local step's save, from ``_before_local`` to its ``after``."""

    nodes: Nodes | None = None


def _before_local(manager: CheckpointManager, step: int, box: _Box, comm: Comm) -> None:
    """Before a local step's write: this node's tier cleared of step ``step`` and later."""
    assert manager.local_dir is not None
    box.nodes = clear_local(comm, manager.local_dir, step, manager.failure_domain)


def _after_local(manager: CheckpointManager, step: int, box: _Box, result: SaveResult,
                 comm: Comm) -> SaveResult:
    """After a local step's commit: the node's record, its copies to other nodes."""
    assert manager.local_dir is not None and box.nodes is not None
    share_local(comm, box.nodes, manager.local_dir, step, replicas=manager.replicas,
                keep_local=manager.keep_local)
    return result


def _after_preempt_step(manager: CheckpointManager, step: int, name: str, started: float,
                        box: _Box, restorable: Future[SaveResult], result: SaveResult,
                        comm: Comm) -> SaveResult:
    """The preemption save with local steps: a local step (``restorable`` resolves once it is
    held by this node and copied to others), then, with ``PreemptionPolicy.persist``, the same
    files committed at the URL (manager/promote.py) and retention."""
    try:
        result = _after_local(manager, step, box, result, comm)
    except BaseException as e:
        restorable.set_exception(e)
        raise
    restorable.set_result(result)
    if not manager.preemption.persist:
        return result
    assert manager.local_dir is not None
    root = os.path.join(manager.local_dir, name)
    target = PrefixedStore(manager._open_agreed(comm, f"save: opening {manager.url}"), name)
    with claimed(target, comm, False, manager._backend) as claim:
        comm.run_on_coordinator(f"save: clearing a dead save's files at {manager._url(name)}",
                                lambda: run_sync(clear_dead(target, claim)))
        total = promote(root, target, result.files, comm, store_options=manager.store_options)
    manager._retain(comm)
    return replace(result, url=manager._url(name), total_bytes=total,
                   seconds=time.perf_counter() - started)
