"""What ``ckptfs inspect`` shows: a checkpoint's versions, writer, totals (for a delta checkpoint
the chunk bytes written and those referenced in its bases), tensors and values, from the index
alone (no tensor data is read)."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import Index, TensorEntry
from ckptfs.layout.values import decode_value


def matches(key: str, pattern: str | None) -> bool:
    """A glob (``model/*.weight``), or a plain key naming a leaf or a subtree."""
    if pattern is None:
        return True
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return key == pattern or key.startswith(pattern + "/")


def _bytes(e: TensorEntry) -> int:
    try:
        return e.numel * from_name(e.dtype, e.key).itemsize
    except Exception:
        return 0


def _references(index: Index) -> dict[str, Any] | None:
    """A delta checkpoint's chunk bytes written here vs referenced in its bases (§2.5), from
    the index alone; None for a checkpoint without references."""
    if not index.references:
        return None
    written = referenced = chunks = 0
    by_base: dict[str, int] = {}
    for c in index.chunks():
        n = c.byte_length or 0
        if c.base is None:
            written += n
        else:
            referenced, chunks = referenced + n, chunks + 1
            by_base[c.base] = by_base.get(c.base, 0) + n
    return {"written_bytes": written, "referenced_bytes": referenced,
            "referenced_chunks": chunks, "bases": by_base}


def describe(url: str, index: Index, foreign: bool, pattern: str | None = None) -> dict[str, Any]:
    """The JSON document of ``ckptfs inspect --json``. Values keep the index's JSON encoding
    (non-finite floats as ``{"$float": "nan"}``)."""
    tensors = [e for k, e in index.tensors.items() if matches(k, pattern)]
    values = {k: v for k, v in index.values.items() if matches(k, pattern)}
    doc = {
        "url": url,
        "format_version": index.format_version,
        "backend": {"name": index.backend, "version": index.backend_version,
                    "options": dict(index.backend_options)},
        "foreign": foreign,
        "writer": dict(index.writer),
        "totals": {"tensors": len(index.tensors), "values": len(index.values),
                   "chunks": sum(len(e.chunks) for e in index.tensors.values()),
                   "files": len(index.files), "file_bytes": index.total_bytes,
                   "tensor_bytes": sum(_bytes(e) for e in index.tensors.values())},
        "selected": {"pattern": pattern, "tensors": len(tensors), "values": len(values)},
        "tensors": [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "bytes": _bytes(e),
                     "chunks": len(e.chunks)} for e in tensors],
        "values": values,
    }
    refs = _references(index)
    if refs is not None:  # a delta checkpoint (§2.5): bytes written vs referenced
        doc["references"] = refs
    if index.segments is not None:  # a segmented index (§2.6): its segment files
        doc["segments"] = {p: index.files.get(p) for p in index.segments}
    return doc


def human(n: int) -> str:
    x: float = n
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(x)


def render(doc: dict[str, Any]) -> str:
    """The text form: a header, then a table of tensors and one line per value."""
    be, w, tot = doc["backend"], doc["writer"], doc["totals"]
    lines = [f"checkpoint  {doc['url']}",
             f"format      ckptfs {doc['format_version']}, backend {be['name']}-{be['version']}"
             + (f" {json.dumps(be['options'], sort_keys=True)}" if be["options"] else "")
             + ("  (no ckptfs index: read from the foreign files)" if doc["foreign"] else "")]
    who = " ".join(f"{k}={w[k]}" for k in ("library", "library_version", "torch_version",
                                            "world_size", "created") if k in w)
    if who:
        lines.append(f"writer      {who}")
    lines.append(f"totals      {tot['tensors']} tensors ({human(tot['tensor_bytes'])}), "
                 f"{tot['values']} values, {tot['chunks']} chunks, {tot['files']} files "
                 f"({human(tot['file_bytes'])})")
    refs = doc.get("references")
    if refs:
        bases = ", ".join(f"{u} ({human(n)})" for u, n in refs["bases"].items())
        lines.append(f"delta       {human(refs['written_bytes'])} of chunks written, "
                     f"{human(refs['referenced_bytes'])} in {refs['referenced_chunks']} chunks "
                     f"referenced in base(s) {bases}")
    segs = doc.get("segments")
    if segs:
        lines.append(f"index       segmented: {len(segs)} segment files "
                     f"({human(sum(n or 0 for n in segs.values()))}) beside the root")
    sel = doc["selected"]
    if sel["pattern"] is not None:
        lines.append(f"selected    {sel['tensors']} tensors, {sel['values']} values matching "
                     f"{sel['pattern']!r}")
    rows = [(t["key"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", human(t["bytes"]),
             str(t["chunks"])) for t in doc["tensors"]]
    if rows:
        head = ("key", "dtype", "shape", "bytes", "chunks")
        width = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
        lines.append("")
        for r in [head, *rows]:
            lines.append("  ".join(c.rjust(width[i]) if i >= 3 else c.ljust(width[i])
                                   for i, c in enumerate(r)).rstrip())
    if doc["values"]:
        lines.append("")
        for k, v in doc["values"].items():
            lines.append(f"{k} = {decode_value(v, k)!r}")
    return "\n".join(lines)
