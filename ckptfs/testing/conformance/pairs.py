"""Which (backend, version) pairs the suite runs, and whether each can be imported here."""

from __future__ import annotations

from dataclasses import dataclass

import ckptfs

#: Pairs ckptfs ships: their golden checkpoints must exist in the built-in golden root.
GOLDEN_REQUIRED: frozenset[tuple[str, int]] = frozenset({
    ("safetensors_chunks", 1), ("zarr", 2), ("zarr", 3), ("torch_dist", 1), ("hf_safetensors", 1),
})


@dataclass(frozen=True, order=True)
class Pair:
    """One registered backend layout."""

    name: str
    version: int

    @property
    def id(self) -> str:
        return f"{self.name}-{self.version}"

    def __str__(self) -> str:
        return self.id


def parse_pair(text: str) -> list[Pair]:
    """``NAME:VERSION`` (one pair) or ``NAME`` (every registered version of NAME)."""
    name, sep, version = text.partition(":")
    registered = [Pair(n, v) for n, v in ckptfs.available_backends()]
    if sep:
        try:
            chosen = [Pair(name, int(version))]
        except ValueError:
            raise ValueError(f"--backend {text!r}: VERSION must be an integer (NAME:VERSION)") from None
    else:
        chosen = [p for p in registered if p.name == name]
    if not chosen or any(p not in registered for p in chosen):
        known = ", ".join(f"{p.name}:{p.version}" for p in registered) or "none"
        raise ValueError(f"--backend {text!r} is not registered; registered backends: {known}")
    return chosen


def select_pairs(requested: list[str] | None) -> list[Pair]:
    """The pairs named by ``--backend`` options, or every registered pair."""
    if not requested:
        return [Pair(n, v) for n, v in ckptfs.available_backends()]
    out: list[Pair] = []
    for text in requested:
        out.extend(p for p in parse_pair(text) if p not in out)
    return out


def import_error(pair: Pair) -> str | None:
    """None when the pair's backend class imports; otherwise why it does not."""
    try:
        ckptfs.get_backend(pair.name, pair.version)
    except Exception as e:  # ImportError, AttributeError of a half-written module, ...
        return f"{type(e).__name__}: {e}"
    return None


def is_writable(pair: Pair) -> bool:
    """False for read-only pairs (``Backend.writable``): their save-based cases are skipped."""
    try:
        return bool(ckptfs.get_backend(pair.name, pair.version).writable)
    except Exception:  # not importable: the pair is skipped anyway
        return True


def importable_pairs() -> list[Pair]:
    return [p for p in select_pairs(None) if import_error(p) is None]
