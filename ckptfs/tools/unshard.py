"""``ckptfs.unshard``: whole tensors of a checkpoint into plain files, a bounded batch at a time.

Formats: ``safetensors`` and ``hf`` hold tensors only (a safetensors header has no place for
Python values such as an optimizer's step and param_groups); ``torch`` holds everything
``torch.load(weights_only=True)`` can read back. Strategies, as in OLMo-core's
``unshard_checkpoint``:

| strategy | safetensors | torch | hf |
|---|---|---|---|
| one_file | checkpoint.safetensors | checkpoint.pt (the nested state dict) | model.safetensors |
| one_file_per_tensor | <key>.safetensors | <key>.pt | model-0000i-of-0000N.safetensors + index |
| chunks | chunk-00000.safetensors ... | chunk-00000.pt ... | model-0000i-of-0000N.safetensors + index |

``<key>`` is the canonical key, percent-encoded to one file name. Files of one_file_per_tensor
and chunks map canonical keys to leaves; ``chunks`` packs leaves in key order into files of at
most ``chunk_size`` bytes (a larger tensor alone). When ``keys`` names exactly one container
(e.g. ``["model"]``), names are relative to it, so ``--keys model --format hf`` gives the
model's own parameter names.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.engine.errors import public_errors
from ckptfs.errors import UsageError
from ckptfs.io import StoreOptions
from ckptfs.io.progress import summary
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.keys import encode_component
from ckptfs.layout.values import decode_value
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.state.flatten import unflatten
from ckptfs.tools.export_dir import HF_INDEX, HF_SINGLE, ExportDir
from ckptfs.tools.phases import PhaseClock, PhaseTimes
from ckptfs.tools.raw_copy import RawCopier, RawRun, raw_runs
from ckptfs.tools.safetensors_file import (
    SafetensorsPart,
    SafetensorsWriter,
    TensorSpec,
    create_sized,
    layout,
)
from ckptfs.tools.source import (
    DEFAULT_BUFFER,
    Region,
    Selection,
    Source,
    nbytes,
    open_checkpoint,
    progress_bar,
    read_regions,
    select,
)
from ckptfs.tools.torch_file import TorchFileWriter

FORMATS = ("safetensors", "torch", "hf")
STRATEGIES = ("one_file", "one_file_per_tensor", "chunks")


@dataclass(frozen=True)
class UnshardResult:
    """What ``unshard`` wrote."""

    out_dir: str
    format: str
    strategy: str
    files: tuple[str, ...]  #: relative to out_dir, in writing order (the hf index last)
    tensors: int
    values: int
    bytes_written: int  #: by every rank together
    seconds: float
    ranks: int = 1  #: the processes that shared the work
    kept: tuple[str, ...] = ()  #: files a resumed export found complete and left as they were
    #: where this rank's time went (phase -> wall seconds; its CPU seconds), tools/phases.py
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    #: ``export_hf``: the bytes of each host buffer this rank allocated for its rounds (one,
    #: however many rounds ran; empty when nothing moved); ``unshard`` leaves it empty
    host_buffers: tuple[int, ...] = ()


@dataclass(frozen=True)
class _FilePlan:
    name: str
    tensors: tuple[str, ...]  #: checkpoint keys, in the order their bytes are written
    values: tuple[str, ...]
    nested: bool  #: a torch one_file file (the nested state dict) rather than a flat one


@moved_keywords("unshard", REMOVED["store"])
def unshard(url: str | os.PathLike, out_dir: str | os.PathLike, *, format: str = "safetensors",
            strategy: str = "one_file", chunk_size: int | None = None,
            keys: Iterable[str | tuple] | None = None, overwrite: bool = False,
            resume: bool = False, storage_options: Mapping[str, Any] | None = None,
            store_options: StoreOptions | None = None,
            buffer_bytes: int = DEFAULT_BUFFER, verify: bool = True,
            progress: bool = False, process_group: ProcessGroup | None = None) -> UnshardResult:
    """Write the whole (unsharded) tensors of the checkpoint at ``url`` (any backend, or a
    DCP, Megatron or Hugging Face directory; local or remote) as files in the local directory
    ``out_dir``. Holds at most ``buffer_bytes`` of tensor data, or one larger tensor, per rank
    (a tensor whose chunks are raw row runs of a local checkpoint's files is copied from them
    into a safetensors file in pieces through one small buffer instead, tools/raw_copy.py).
    Refuses to replace existing files unless ``overwrite``; ``resume`` keeps the files an
    interrupted export finished and writes the others.

    In an initialised process group the call is collective: every rank of ``process_group``
    (default: the whole job) calls it with the same arguments, the files are assigned to the
    ranks, and the hf index is written once, after every file. Safetensors files written to a
    local directory are shared: the coordinator makes every file at its size with its header,
    and each rank writes its part, a contiguous run of the files' tensors (in file and data
    order) balanced by bytes, so the ranks' shares differ by at most one tensor whatever the
    number and sizes of the files. Torch files, and files uploaded to an object store (an
    object is uploaded whole by one rank), go whole to the ranks, balanced by bytes. Which file
    holds which tensor depends on the checkpoint and the arguments only, so the files are the
    same bytes whatever the number of ranks."""
    t0 = time.perf_counter()
    _check_args(format, strategy, chunk_size, resume)
    comm = Comm(process_group)
    clock = PhaseClock()
    with public_errors(os.fspath(url)), open_checkpoint(url, storage_options, store_options) as src, \
            _export_dir(out_dir, storage_options, store_options) as out:
        with clock.phase("plan"):
            sel = select(src.index, keys, src.url)
            _check_values(sel, format, strategy)
            plans = _plan(src, sel, format, strategy, chunk_size)
            indexed = format == "hf" and strategy != "one_file"
            names = [p.name for p in plans] + ([HF_INDEX] if indexed else [])
            expected = _expected(src, sel, plans, format)
            shared = _shared_files(plans, format, out, comm.size)
        clock.add("open", time.perf_counter() - t0 - clock.times().get("plan"))
        with clock.phase("prepare"):
            done = comm.run_on_coordinator(f"preparing {out}", lambda: _prepare(
                out, names, format == "hf", overwrite, resume, expected, shared))
        label = f"ckptfs unshard {src.url}" + (f" [rank {comm.rank}/{comm.size}]" if comm.size > 1 else "")
        work = _work(src, sel, plans, shared, done, out, format, buffer_bytes, verify, progress,
                     label, comm, clock)
        t1 = time.perf_counter()
        _, counts = comm.run_everywhere(f"writing the files of {out}", partial(_timed_work, work, clock),
                                        lambda n: n, to="all")
        clock.add("wait for ranks", time.perf_counter() - t1 - clock.times().get("own files"))
        with clock.phase("finish"):
            written = sum(counts) + comm.run_on_coordinator(f"finishing {out}", lambda: _finish(
                out, shared, expected, done, _hf_index(src, sel, plans) if indexed else None))
    seconds = time.perf_counter() - t0
    if progress and comm.is_coordinator:
        print(summary(f"ckptfs unshard {src.url} -> {out} ({comm.size} rank(s))", written, seconds),
              file=sys.stderr)
    return UnshardResult(out.url, format, strategy, tuple(names), len(sel.tensors),
                         len(sel.values), written, seconds, comm.size,
                         tuple(sorted(done)), clock.times())


def _timed_work(work: Callable[[], int], clock: PhaseClock) -> int:
    """``work()``, its whole time as phase "own files" (its parts: "read wait", waiting for the
    tensors' reads; "write", writing their bytes; "files", opening, closing and naming files)."""
    with clock.phase("own files"):
        return work()


def _work(src: Source, sel: Selection, plans: list[_FilePlan], shared: list[_FilePlan],
          done: set[str], out: ExportDir, format: str, buffer_bytes: int, verify: bool,
          progress: bool, label: str, comm: Comm, clock: PhaseClock) -> Callable[[], int]:
    """This rank's writing: its part of the shared files, or its files whole."""
    if shared:
        todo = _share(src, [p for p in shared if p.name not in done], comm.rank, comm.size)
        return partial(_write_share, src, sel, todo, out, format, buffer_bytes, verify,
                       progress, label, comm.rank, clock)
    owner = assign_files([_plan_bytes(src, p) for p in plans], comm.size)
    mine = [p for p, r in zip(plans, owner, strict=True) if r == comm.rank and p.name not in done]
    return partial(_write, src, sel, mine, out, format, buffer_bytes, verify, progress, label,
                   comm.rank, clock)


def assign_files(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that writes each file: the largest file first, each to the rank with the
    fewest bytes so far (the lowest rank on a tie). A pure function of the sizes and the
    number of ranks; the files themselves never depend on it."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _shared_files(plans: list[_FilePlan], format: str, out: ExportDir, ranks: int) -> list[_FilePlan]:
    """The safetensors files every rank writes a part of: all of them when several ranks write
    into a local directory; none for torch files, one rank, or an object store (an object is
    uploaded whole by one rank), whose files each have one writer."""
    share = format != "torch" and ranks > 1 and out.store is None
    return list(plans) if share else []


def share_ranges(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that writes each of consecutive items of ``sizes`` bytes: contiguous runs,
    balanced by bytes (an item goes to the rank whose share holds its middle byte)."""
    total = sum(sizes) or 1
    owner = []
    pos = 0
    for n in sizes:
        owner.append(min(ranks - 1, (2 * pos + n) * ranks // (2 * total)))
        pos += n
    return owner


def _share(src: Source, plans: list[_FilePlan], rank: int, ranks: int) -> list[tuple[_FilePlan, str]]:
    """This rank's tensors of the shared files ``plans`` (each with its file), in file and data
    order: a contiguous run of them, balanced by bytes over the ranks."""
    items = [(p, k) for p in plans for k in p.tensors]
    owner = share_ranges([nbytes(src.index.tensors[k]) for _, k in items], ranks)
    return [it for it, r in zip(items, owner, strict=True) if r == rank]


def _prepare(out: ExportDir, names: list[str], hf: bool, overwrite: bool, resume: bool,
             expected: dict[str, tuple[int, bytes]], shared: list[_FilePlan]) -> set[str]:
    """The coordinator's claim of ``out``; then each shared file not already done is made at
    its full size with its header, for every rank to write its part into."""
    done = out.claim(names, hf, overwrite, resume, expected)
    for plan in shared:
        if plan.name not in done:
            size, header = expected[plan.name]
            create_sized(out.partial(plan.name), header, size)
    return done


def _finish(out: ExportDir, shared: list[_FilePlan], expected: dict[str, tuple[int, bytes]],
            done: set[str], index: bytes | None) -> int:
    """The coordinator, after every rank wrote: the shared files take their names (their
    headers counted here), then the index."""
    header = 0
    for plan in shared:
        if plan.name not in done:
            out.publish(plan.name)
            header += len(expected[plan.name][1])
    return header + out.finish(index)


def _write_share(src: Source, sel: Selection, items: list[tuple[_FilePlan, str]], out: ExportDir,
                 format: str, buffer_bytes: int, verify: bool, progress: bool, label: str,
                 rank: int, clock: PhaseClock) -> int:
    """Write the tensors ``items`` (each with its shared file) into their places."""
    if not items:
        return 0
    keys = [k for _, k in items]
    bar = progress_bar(sum(nbytes(src.index.tensors[k]) for k in keys), label, progress,
                       position=rank)
    parts: dict[str, SafetensorsPart] = {}
    total = 0
    runs, stream = _sources(src, keys, format, buffer_bytes, verify, clock)
    copier = RawCopier(src.url, verify)
    try:
        for plan, key in items:
            part = parts.get(plan.name)
            if part is None:
                with clock.phase("files"):
                    part = parts[plan.name] = SafetensorsPart(
                        out.partial(plan.name), _specs(src, sel, plan.tensors), _metadata(format))
            n = _put(src, part, sel.relative(key), key, runs, copier, stream, clock)
            bar.update(n)
            total += n
    finally:
        stream.close()  # no read left running into the reused buffers
        copier.close()
        for part in parts.values():
            part.close()
        bar.close(done=False)
    return total


def _sources(src: Source, keys: list[str], format: str, buffer_bytes: int, verify: bool,
             clock: PhaseClock) -> tuple[dict[str, tuple[RawRun, ...]], Generator]:
    """How the tensors ``keys`` arrive: the runs of those copied straight from a local
    checkpoint's files into safetensors files (raw_copy.py), and a stream of the others read
    by the read engine, in order."""
    entries = [src.index.tensors[k] for k in keys]
    runs = raw_runs(src, entries) if format != "torch" else {}
    regions = [Region.whole(e) for e in entries if e.key not in runs]
    return runs, _timed(read_regions(src, regions, buffer_bytes=buffer_bytes, verify=verify,
                                     ahead=True, reuse=True), clock)


def _put(src: Source, writer: SafetensorsPart | SafetensorsWriter | TorchFileWriter, name: str,
         key: str, runs: Mapping[str, tuple[RawRun, ...]], copier: RawCopier,
         stream: Iterator, clock: PhaseClock) -> int:
    """Tensor ``key`` into ``writer`` as ``name``: copied (phase "copy": read, checked and
    written in one pass) when it has runs, else the next tensor of ``stream`` written (phase
    "write"). Returns its bytes."""
    mine = runs.get(key)
    if mine is not None:
        entry = src.index.tensors[key]
        assert not isinstance(writer, TorchFileWriter)
        with clock.phase("copy"):
            fd, at = writer.place(name, from_name(entry.dtype, key).torch, tuple(entry.shape))
            return copier.copy(key, mine, fd, at)
    region, data = next(stream)
    assert region.entry.key == key
    with clock.phase("write"):
        writer.write(name, data)
    return data.nbytes


def _timed(stream: Iterator[T], clock: PhaseClock) -> Generator[T, None, None]:
    """``stream``'s items, the time spent waiting for each added to phase "read wait"."""
    try:
        while True:
            with clock.phase("read wait"):
                item = next(stream, _END)
            if item is _END:
                return
            yield item  # type: ignore[misc]
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


_END = object()
T = TypeVar("T")


def _plan_bytes(src: Source, plan: _FilePlan) -> int:
    return sum(nbytes(src.index.tensors[k]) for k in plan.tensors)


def _check_args(format: str, strategy: str, chunk_size: int | None,
                resume: bool = False) -> None:
    if resume and format == "torch":
        raise UsageError("resume applies to formats safetensors and hf (their files are checked "
                         "against the planned header and size); rerun a torch export with overwrite")
    if format not in FORMATS:
        raise UsageError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy == "chunks" and (chunk_size is None or chunk_size < 1):
        raise UsageError("strategy 'chunks' needs chunk_size (bytes per file, at least 1)")
    if strategy != "chunks" and chunk_size is not None:
        raise UsageError(f"chunk_size applies to strategy 'chunks' only, not {strategy!r}")


def _check_values(sel: Selection, format: str, strategy: str) -> None:
    if not sel.values:
        return
    shown = ", ".join(repr(k) for k in sel.values[:3]) + (" ..." if len(sel.values) > 3 else "")
    if format in ("safetensors", "hf"):
        raise UsageError(
            f"{len(sel.values)} Python value(s) such as {shown} cannot go into {format} files, "
            f"which hold tensors only (optimizer state has steps and param_groups): use "
            f"format 'torch', or select tensors with keys (e.g. keys=['model'], --keys model)")
    if strategy == "one_file_per_tensor":
        raise UsageError(
            f"{len(sel.values)} Python value(s) such as {shown} have no tensor file of their "
            f"own: use strategy 'one_file' or 'chunks', or select tensors with keys (--keys)")


def _plan(src: Source, sel: Selection, format: str, strategy: str,
          chunk_size: int | None) -> list[_FilePlan]:
    ext = ".pt" if format == "torch" else ".safetensors"
    idx = src.index
    if strategy == "one_file":
        name = HF_SINGLE if format == "hf" else f"checkpoint{ext}"
        groups = [(name, list(sel.tensors), list(sel.values))]
    elif strategy == "one_file_per_tensor":
        groups = [(f"{quote(sel.relative(k), safe='')}{ext}", [k], []) for k in sel.tensors]
    else:
        assert chunk_size is not None
        groups = []
        cur_t: list[str] = []
        cur_v: list[str] = []
        size = 0
        for k in sorted((*sel.tensors, *sel.values)):
            n = nbytes(idx.tensors[k]) if k in idx.tensors else 0
            if cur_t and size + n > chunk_size:
                groups.append(("", cur_t, cur_v))
                cur_t, cur_v, size = [], [], 0
            (cur_t if k in idx.tensors else cur_v).append(k)
            size += n
        if cur_t or cur_v:
            groups.append(("", cur_t, cur_v))
        groups = [(f"chunk-{i:05d}{ext}", t, v) for i, (_, t, v) in enumerate(groups)]
    if format == "hf" and strategy != "one_file":
        n = len(groups)
        groups = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", t, v)
                  for i, (_, t, v) in enumerate(groups)]
    plans = []
    for name, tensors, values in groups:
        if format != "torch":  # the safetensors data order
            by_name = {sel.relative(k): k for k in tensors}
            _, order = layout(_specs(src, sel, tensors))
            tensors = [by_name[s.name] for s in order]
        plans.append(_FilePlan(name, tuple(tensors), tuple(values),
                               format == "torch" and strategy == "one_file"))
    return plans


def _specs(src: Source, sel: Selection, keys: Iterable[str]) -> list[TensorSpec]:
    return [TensorSpec(sel.relative(k), from_name(src.index.tensors[k].dtype, k),
                       src.index.tensors[k].shape) for k in keys]


def _expected(src: Source, sel: Selection, plans: list[_FilePlan],
              format: str) -> dict[str, tuple[int, bytes]]:
    """(size, header bytes) of every planned safetensors file (none for torch files)."""
    if format == "torch":
        return {}
    out = {}
    for p in plans:
        header, order = layout(_specs(src, sel, p.tensors), _metadata(format))
        out[p.name] = (len(header) + sum(s.nbytes for s in order), header)
    return out


def _metadata(format: str) -> dict[str, str]:
    return {"format": "pt"} if format == "hf" else {"format": "ckptfs.unshard"}


def _write(src: Source, sel: Selection, plans: list[_FilePlan], out: ExportDir, format: str,
           buffer_bytes: int, verify: bool, progress: bool, label: str, rank: int = 0,
           clock: PhaseClock | None = None) -> int:
    """Open each file's writer in turn and feed it from one stream of tensors; a file takes its
    name in ``out`` once complete (export_dir.py)."""
    clock = clock or PhaseClock()
    keys = [k for p in plans for k in p.tensors]
    runs, stream = _sources(src, keys, format, buffer_bytes, verify, clock)
    copier = RawCopier(src.url, verify)
    bar = progress_bar(sum(nbytes(src.index.tensors[k]) for k in keys), label, progress,
                       position=rank)
    total = 0
    try:
        for plan in plans:
            with clock.phase("files"):
                writer = _open_writer(src, sel, plan, out.partial(plan.name), format)
            try:
                for key in plan.tensors:
                    name = _file_key(sel, plan, key) if format == "torch" else sel.relative(key)
                    bar.update(_put(src, writer, name, key, runs, copier, stream, clock))
            except BaseException:
                writer.abort()
                raise
            with clock.phase("files"):
                writer.close()
                out.publish(plan.name)
            total += writer.nbytes
    finally:
        stream.close()  # no read left running into the reused buffers
        copier.close()
        bar.close(done=False)  # the caller prints one line for every rank
    return total


def _file_key(sel: Selection, plan: _FilePlan, key: str) -> str:
    """The canonical key of ``key`` inside a torch file: its path relative to the root in the
    nested one_file file, one component (the relative key) in the flat files."""
    return sel.relative(key) if plan.nested else encode_component(sel.relative(key))


def _open_writer(src: Source, sel: Selection, plan: _FilePlan, path: Path,
                 format: str) -> SafetensorsWriter | TorchFileWriter:
    idx = src.index
    if format != "torch":
        return SafetensorsWriter(path, _specs(src, sel, plan.tensors), _metadata(format))

    def build(make):
        leaves: dict[str, Any] = {}
        for k in plan.tensors:
            e = idx.tensors[k]
            leaves[sel.relative(k)] = make(_file_key(sel, plan, k), from_name(e.dtype, k).torch, e.shape)
        for k in plan.values:
            leaves[sel.relative(k)] = decode_value(idx.values[k], k)
        if plan.nested:  # one_file: the nested state dict, exact types, dicts in the saved order
            order = None if idx.order is None else [
                sel.relative(k) for k in idx.order if not sel.root or k.startswith(sel.root + "/")]
            return unflatten(sel.containers(idx), leaves, order)
        return leaves  # flat: canonical key -> leaf

    return TorchFileWriter(path, build)


def hf_index(weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> bytes:
    """``model.safetensors.index.json``: the file of every tensor, as transformers writes it."""
    doc = {"metadata": {"total_size": total_size, "total_parameters": total_parameters},
           "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


def _hf_index(src: Source, sel: Selection, plans: list[_FilePlan]) -> bytes:
    return hf_index({sel.relative(k): p.name for p in plans for k in p.tensors},
                    sum(nbytes(src.index.tensors[k]) for k in sel.tensors),
                    sum(src.index.tensors[k].numel for k in sel.tensors))


@contextmanager
def _export_dir(out_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None,
                store_options: StoreOptions | None) -> Iterator[ExportDir]:
    with public_errors(os.fspath(out_dir)):
        out = ExportDir(out_dir, storage_options, store_options)
    try:
        yield out
    finally:
        out.close()
