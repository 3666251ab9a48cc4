"""Progress of bytes moved, on stderr: a bar on a terminal, one summary line when it closes.

On a terminal the bar is drawn while bytes move and erased when it closes; in a log (stderr is
not a terminal) nothing is drawn while it runs. Either way closing it prints one line:
``ckptfs save URL: 1.20 GB in 2.41 s (0.50 GB/s)``.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class ByteProgress:
    """Counts bytes; ``update(n)`` as they move, ``close()`` once (prints the summary line)."""

    def __init__(self, total: int, desc: str, unit: str = "B", position: int = 0) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self._t0 = time.perf_counter()
        self._closed = False
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False,
                             position=position)  # several processes on one terminal: a line each

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def add_total(self, n: int) -> None:
        """Raise the total by ``n`` (work found while running)."""
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def close(self, done: bool = True) -> None:
        """Erase the bar; print the summary line unless the work failed (``done=False``)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if done:
            print(summary(self.desc, self.done, time.perf_counter() - self._t0, self.unit),
                  file=sys.stderr)

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoProgress:
    """The stand-in when progress is off: ignores updates, prints nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def add_total(self, n: int) -> None:
        pass

    def close(self, done: bool = True) -> None:
        pass


def summary(desc: str, done: int, seconds: float, unit: str = "B") -> str:
    """``desc: 1.20 GB in 2.41 s (0.50 GB/s)`` (kB, MB, GB = 10**3, 10**6, 10**9 bytes); other
    units as counts."""
    if unit != "B":
        return f"{desc}: {done} {unit} in {seconds:.2f} s"
    rate = done / seconds / 1e9 if seconds > 0 else 0.0
    return f"{desc}: {size(done)} in {seconds:.2f} s ({rate:.2f} GB/s)"


def size(n: int) -> str:
    """``1.20 GB``, ``399.80 kB``, ``12 B``."""
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n} B"


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B",
                 position: int = 0) -> ByteProgress | NoProgress:
    """A ``ByteProgress`` when ``enabled``, else a ``NoProgress``."""
    return ByteProgress(total, desc, unit, position) if enabled else NoProgress()
