"""What ``ckptfs inspect --stats`` shows: the fingerprints an index records (formats/README.md
§2.4), read from the index alone."""

from __future__ import annotations

from typing import Any

from ckptfs.layout.index import Index
from ckptfs.tools.describe import matches


def fingerprints(index: Index, pattern: str | None = None) -> list[dict[str, Any]]:
    """One row per selected tensor with a recorded fingerprint: key and its numbers."""
    return [{"key": k, **e.stats.to_dict()} for k, e in index.tensors.items()
            if e.stats is not None and matches(k, pattern)]


def render_fingerprints(rows: list[dict[str, Any]], recorded: bool) -> str:
    """The text table (``recorded``: the index holds fingerprints at all)."""
    if not rows:
        return ("no fingerprints match" if recorded else
                "no fingerprints recorded (saved without stats=True)")
    head = ("key", "count", "nan", "inf", "min", "max", "mean", "l2")
    table = [head] + [tuple(_cell(r.get(h)) for h in head) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in table)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return str(v.get("$float"))
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
