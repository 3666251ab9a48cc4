"""DCP's ``FileSystemWriter`` / ``FileSystemReader`` arguments on the plug-in, and DCP's
``overwrite`` semantics (the table in docs/dcp.md).

Each argument keeps DCP's default and is accepted with DCP's meaning, mapped to a ckptfs option
or refused with a ``ConfigError`` that names it; none is taken and silently ignored:

- ``single_file_per_rank``: True (DCP's default): each rank packs its items into files of its
  own; False (one file per item): ``safetensors_chunks``' ``max_file_bytes=1`` (one chunk per
  file), refused for the other backends.
- ``sync_files``: ``StoreOptions.fsync`` (either turns it off).
- ``thread_count``: requests in flight per rank, ``StoreOptions.max_concurrency`` (raised to it,
  never lowered: ckptfs already writes concurrently).
- ``per_thread_copy_ahead``: accepted; the plug-in copies a rank's items to host memory whole
  before writing them (the bound has nothing to bound).
- ``cache_staged_state_dict``: DCP's own ``BlockingAsyncStager`` (the writer is the stager of
  ``dcp.async_save``, as ``FileSystemWriter`` is).
- ``overwrite``: True by default, as DCP's; the replaced checkpoint stays loadable until the new
  index commits where the backend writes every data file under a name of its own save
  (``ATOMIC_REPLACE``); a refusal's words contain DCP's "Checkpoint already exists".
- ``_extensions``: DCP's stream transforms (``ZStandard``) are refused by name: a ckptfs chunk is
  a byte range of raw row-major elements, which a load reads in part; compression belongs to a
  backend's codecs (``backend="zarr", backend_options={"compressor": "zstd"}``).
- ``serialization_format``: the layout is ``backend=``'s; DCP's default (``TORCH_SAVE``) is
  accepted, ``SAFETENSORS`` refused (``safetensors_chunks``, the default backend, writes
  safetensors files).
- Reader ``_extension_registry``: accepted; a ckptfs checkpoint holds no transformed chunk; a
  tensor of DCP's own layout stored with transforms is refused by name when read (an object so
  stored is left out of the index with a warning naming it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import SerializationFormat

from ckptfs.engine.save.commit import Claim
from ckptfs.errors import CheckpointExistsError, ConfigError, SaveInProgressError
from ckptfs.io import Store, StoreOptions, run_sync
from ckptfs.layout.index import INDEX_FILE

#: backends whose every data file is named after its save (``data/<save id>/``): a save that
#: replaces a checkpoint keeps the old index until its own commits (the old checkpoint stays
#: loadable, and a failed save leaves it as it was). Other backends (zarr's chunk keys are the
#: same in every save) un-commit the old index before writing, as ``ckptfs.save`` does.
ATOMIC_REPLACE = frozenset({"safetensors_chunks", "torch_dist"})

#: DCP's words when a checkpoint is at the target and ``overwrite`` is off (filesystem.py)
EXISTS_PHRASE = "Checkpoint already exists"


@dataclass(frozen=True, slots=True)
class WriterArgs:
    """``FileSystemWriter``'s arguments, with its defaults."""

    single_file_per_rank: bool = True
    sync_files: bool = True
    thread_count: int = 1
    per_thread_copy_ahead: int = 10_000_000
    overwrite: bool = True
    extensions: tuple[Any, ...] = ()
    serialization_format: Any = SerializationFormat.TORCH_SAVE


@dataclass(frozen=True, slots=True)
class Mapped:
    """What ``WriterArgs`` become in ckptfs's terms."""

    backend_options: Mapping[str, Any]
    store_options: StoreOptions | None


def check_extensions(extensions: Sequence[Any] | None) -> tuple[Any, ...]:
    """DCP's ``_extensions``: none (None or empty) is accepted; any other is refused by name."""
    exts = tuple(extensions or ())
    if not exts:
        return exts
    names = [_descriptor(e) for e in exts]
    raise ConfigError(
        f"_extensions={names}: ckptfs.dcp.StorageWriter does not apply DCP's stream transforms. "
        f"A ckptfs chunk is a byte range of raw elements that a load reads in part (a transformed "
        f"stream must be read whole) and whose crc32c the index records; compress with a "
        f"backend's codecs instead: backend='zarr', backend_options={{'compressor': 'zstd'}}")


def map_writer_args(args: WriterArgs, backend: str, backend_options: Mapping[str, Any],
                    store_options: StoreOptions | None) -> Mapped:
    """The backend and store options that carry ``args`` (refusing what cannot be honoured)."""
    check_extensions(args.extensions)
    if args.serialization_format not in (SerializationFormat.TORCH_SAVE, None):
        raise ConfigError(
            f"serialization_format={args.serialization_format!s}: the files' layout is chosen with "
            f"backend= ('safetensors_chunks', the default, writes safetensors files; "
            f"'torch_dist' writes DCP's torch.save items)")
    _check_int("thread_count", args.thread_count, 1)
    _check_int("per_thread_copy_ahead", args.per_thread_copy_ahead, 0)
    opts = dict(backend_options)
    if not args.single_file_per_rank:
        if backend != "safetensors_chunks":
            raise ConfigError(f"single_file_per_rank=False: backend {backend!r} lays its files "
                              f"out itself; only 'safetensors_chunks' writes one file per item")
        if opts.get("max_file_bytes", 1) != 1:
            raise ConfigError(f"single_file_per_rank=False asks for one file per item, "
                              f"backend_options max_file_bytes={opts['max_file_bytes']} for "
                              f"files of many: pass one of them")
        opts["max_file_bytes"] = 1
    return Mapped(opts, _store_options(args, store_options))


def _store_options(args: WriterArgs, given: StoreOptions | None) -> StoreOptions | None:
    base = given or StoreOptions()
    fsync = base.fsync and args.sync_files
    concurrency = max(base.max_concurrency, args.thread_count)
    if fsync == base.fsync and concurrency == base.max_concurrency:
        return given
    return dataclasses.replace(base, fsync=fsync, max_concurrency=concurrency)


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={value!r}: an int >= {least} is needed")


def _descriptor(ext: Any) -> str:
    try:
        return str(ext.get_descriptor())
    except Exception:  # a foreign object: its type names it
        return type(ext).__qualname__


def keeps_old_index(backend: str) -> bool:
    """Whether a save replacing a checkpoint keeps its index until the new one commits."""
    return backend in ATOMIC_REPLACE


def exists_error(err: CheckpointExistsError) -> CheckpointExistsError:
    """The refusal of a checkpoint at the target in DCP's words, with ckptfs's reason; a save
    in progress (another job's lock) is not an existing checkpoint and stays as it is."""
    if isinstance(err, SaveInProgressError) or EXISTS_PHRASE in str(err):
        return err
    return CheckpointExistsError(f"{EXISTS_PHRASE} and overwrite=False: {err}")


def uncommit_replaced(store: Store, claim: Claim) -> None:
    """At the commit of a save that kept the replaced checkpoint's index (``keeps_old_index``):
    remove that index, just before the new one is created (create-if-absent), as DCP removes
    its old ``.metadata`` just before renaming the new one into place."""
    if claim.committed:
        run_sync(store.delete([INDEX_FILE]))
