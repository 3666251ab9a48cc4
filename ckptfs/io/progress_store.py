"""``ProgressStore``: a store that counts the bytes read through it on a progress bar
(io/progress.py), so a load shows its progress without the read engine knowing."""

from __future__ import annotations

from collections.abc import Sequence

from ckptfs.io.progress import ByteProgress, NoProgress
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Buffer, Store
from ckptfs.io.wrapper import WrapperStore


class ProgressStore(WrapperStore):
    """Forwards to ``base``; every byte a read delivers is counted on ``bar``."""

    def __init__(self, base: Store, bar: ByteProgress | NoProgress) -> None:
        super().__init__(base)
        self.bar = bar

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        data = await super().get_range(path, start, end)
        self.bar.update(len(data))
        return data

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        await super().read_into(path, reads)
        self.bar.update(sum(r.dest.nbytes for r in reads))

    async def read_files(self, items: Sequence[tuple[str, Sequence[ReadInto]]]
                         ) -> list[BaseException | None]:
        errors = await super().read_files(items)
        self.bar.update(sum(r.dest.nbytes for (_, reads), e in zip(items, errors, strict=True)
                            if e is None for r in reads))
        return errors


def load_progress(store: Store, show: bool, desc: str) -> tuple[Store, ByteProgress | NoProgress]:
    """``store`` wrapped to count its reads on a bar described by ``desc`` when ``show`` (the
    caller closes the bar: its summary line), else ``store`` itself and a silent bar."""
    if not show:
        return store, NoProgress()
    bar = ByteProgress(0, desc)
    return ProgressStore(store, bar), bar
