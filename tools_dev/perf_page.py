"""Regenerate the tables of the documentation's performance page from the bench's JSON results.

    python -m tools_dev.perf_page            # rewrite docs/performance.md between its markers
    python -m tools_dev.perf_page --check    # exit 1 if the page differs from what the JSON gives

The newest file of ``docs/perf_results/*.json`` (by its ``date``) gives the current tables: the
``cases`` list that ``bench.perf`` writes (``case``, ``lib``, ``seconds``, ``gbps``,
``floor_kind``, ``floor_gbps``, ``fraction``, ``beside_fraction``, ``nofsync_fraction``,
``over_fsync_floor``,
``page_cache``) with the run's ``date``, ``machine`` and ``command``; one table per state of the
page cache the cases start from (dropped, warm). Older result files stay as JSON; the page shows
the newest only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "perf_results"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
PEERS = ["DCP", "OLMo-core", "Megatron", "Megatron-FP"]
MARKS = {"OLMo-core": " +", "Megatron": " *", "Megatron-FP": " *"}


def newest(results: Path = RESULTS) -> dict[str, Any]:
    docs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    return max(docs, key=lambda d: d["date"])


def _order(case: str) -> tuple:
    return (case[:2], "load" in case and "save" not in case, case)


def page_cache(c: dict[str, Any]) -> str:
    """The page cache a case starts from (results written before the field: by the case)."""
    if "page_cache" in c:
        return c["page_cache"]
    return "warm" if c["case"].startswith(("W6", "W7")) or " warm " in c["case"] else "dropped"


def table(doc: dict[str, Any]) -> str:
    """The markdown of the run's header lines and its tables of cases, by page cache."""
    cases = doc["cases"]
    lines = [f"Run of {doc['date']} on a {doc['machine']}; median of {doc['reps']} runs, "
             f"state {doc['state_bytes'] / 1e9:.2f} GB:", "", "```", doc["command"], "```"]
    for state, title in (("dropped", "Page cache dropped before each case"),
                         ("warm", "Page cache warm (not dropped: what the earlier cases left)")):
        part = [c for c in cases if page_cache(c) == state]
        if part:
            lines += ["", f"**{title}**", "", *_rows(part)]
    return "\n".join(lines)


def _rows(cases: list[dict[str, Any]]) -> list[str]:
    by = {(c["case"], c["lib"]): c for c in cases}
    peers = [p for p in PEERS if any(c["lib"] == p for c in cases)]
    libs = sorted({c["lib"] for c in cases},
                  key=lambda lib: (lib in PEERS, PEERS.index(lib) if lib in PEERS else 0, lib))
    plain = any(c.get("nofsync_fraction") for c in cases)
    synced = any(c.get("over_fsync_floor") for c in cases)
    head = ["case", "library", "time", "GB/s", "floor GB/s", "of floor", "of own files",
            *(["x no fsync"] if plain else []), *(["x fsync floor"] if synced else []),
            *(f"x {p}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in sorted({c["case"] for c in cases}, key=_order):
        for lib in libs:
            c = by.get((case, lib))
            if c is None:
                continue
            ratios = [f"{by[(case, p)]['seconds'] / c['seconds']:.2f}x"
                      if (case, p) in by and lib not in PEERS else "" for p in peers]
            own = f"{c['beside_fraction']:.0%}" if c.get("beside_fraction") is not None else ""
            nofsync = [f"{c['nofsync_fraction']:.2f}x" if c.get("nofsync_fraction") else ""]
            floor = [f"{c['over_fsync_floor']:.2f}x" if c.get("over_fsync_floor") else ""]
            lines.append("| " + " | ".join([
                case, lib + MARKS.get(lib, ""), f"{c['seconds']:.3f} s", f"{c['gbps']:.2f}",
                f"{c['floor_kind']} {c['floor_gbps']:.2f}", f"{c['fraction']:.0%}", own,
                *(nofsync if plain else []), *(floor if synced else []), *ratios]) + " |")
    return lines


def render(page: str, doc: dict[str, Any]) -> str:
    before, _, rest = page.partition(START)
    _, _, after = rest.partition(END)
    return f"{before}{START}\n{table(doc)}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if the page is stale")
    args = ap.parse_args(argv)
    page = PAGE.read_text(encoding="utf-8")
    new = render(page, newest())
    if args.check:
        if new != page:
            print(f"{PAGE} is stale: run python -m tools_dev.perf_page", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
