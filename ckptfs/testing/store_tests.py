"""``StoreTests``: the ``Store`` contract (ckptfs/io/store.py) as a pytest class, for the authors
of a store and for ckptfs's own stores.

Subclass it in a test module and give it a ``store`` fixture that returns a new, empty store
(each test gets its own; close it in the fixture's teardown)::

    import pytest
    from ckptfs.io import open_store, run_sync
    from ckptfs.testing.store_tests import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            store = run_sync(open_store(f"mystore://{tmp_path}"))
            yield store
            run_sync(store.close())

Every test runs the store's coroutines on the ckptfs I/O loop (``ckptfs.io.run_sync``), as the
engine does. Tests that need what a store says it cannot do (``supports_writes``,
``supports_deletes``, ``supports_listing``, ``streams_parts``) are skipped for it. A read-only
store is filled through ``write``: override it to put files in place without the store.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Sequence

import pytest

from ckptfs.errors import MalformedIndexError, ReadOnlyStoreError
from ckptfs.io import ReadInto, ReadOnlyStore, Store, run_sync
from ckptfs.io.streamed import StreamedPart

__all__ = ["StoreTests"]

BLOB = bytes(range(256)) * 40  #: 10,240 bytes, each offset's byte known


class Pieces(StreamedPart):
    """``data`` streamed in views of ``piece`` bytes (what the engine hands a store that
    declares ``streams_parts``)."""

    def __init__(self, data: bytes, piece: int = 1000) -> None:
        self.data, self.piece = data, piece

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def stream(self) -> Generator[memoryview, None, None]:
        mv = memoryview(self.data)
        for start in range(0, len(mv), self.piece):
            yield mv[start : start + self.piece]


def named(path: str) -> str:
    """A pattern for an error message that names ``path``."""
    return re.escape(path)


class StoreTests:
    """The ``Store`` contract, one behaviour per test. Subclasses provide the ``store`` fixture
    and, for a store that cannot write, ``write``."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a StoreTests subclass provides the store fixture")

    def write(self, store: Store, path: str, data: bytes) -> None:
        """Put ``data`` at ``path`` of ``store`` before a reading test (here: ``store.put``)."""
        if not store.supports_writes or store.read_only:
            pytest.skip("the store cannot write and the test class does not override write")
        run_sync(store.put(path, [data]))

    @staticmethod
    def writable(store: Store) -> None:
        if not store.supports_writes or store.read_only:
            pytest.skip("the store does not write")

    # -- capabilities and lifecycle --------------------------------------------------------
    def test_capabilities_are_booleans(self, store: Store) -> None:
        flags = ("read_only", "supports_writes", "supports_deletes", "supports_listing",
                 "supports_ranged_reads", "streams_parts", "streams_in_place")
        assert all(isinstance(getattr(store, f), bool) for f in flags)
        assert store.streams_parts or not store.streams_in_place

    def test_read_only_cannot_be_set(self, store: Store) -> None:
        with pytest.raises(AttributeError):
            store.read_only = not store.read_only  # type: ignore[misc]  # the assignment tested

    @staticmethod
    def closes(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
        """A list that gets one item each time ``store.close()`` is called."""
        closed: list[bool] = []
        close = store.close

        async def spy() -> None:
            closed.append(True)
            await close()

        monkeypatch.setattr(store, "close", spy)
        return closed

    def test_async_with_gives_the_store_and_closes_it(self, store: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        closed = self.closes(store, monkeypatch)

        async def go() -> tuple[Store, list[bool]]:
            async with store as entered:
                return entered, list(closed)

        entered, inside = run_sync(go())
        assert entered is store and inside == [] and closed == [True]

    def test_async_with_closes_on_error(self, store: Store,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        closed = self.closes(store, monkeypatch)

        async def go() -> None:
            async with store:
                raise KeyError("inside")

        with pytest.raises(KeyError, match="inside"):
            run_sync(go())
        assert closed == [True]

    def test_close_twice_is_harmless(self, store: Store) -> None:
        run_sync(store.close())
        run_sync(store.close())

    def test_read_streams_is_none_or_positive(self, store: Store) -> None:
        streams = store.read_streams("a/file")
        assert streams is None or streams >= 1

    # -- reading ---------------------------------------------------------------------------
    def test_get_returns_the_whole_file(self, store: Store) -> None:
        self.write(store, "a/b/file", BLOB)
        assert bytes(run_sync(store.get("a/b/file"))) == BLOB

    def test_get_of_an_empty_file(self, store: Store) -> None:
        self.write(store, "empty", b"")
        assert bytes(run_sync(store.get("empty"))) == b""

    def test_get_missing_raises_file_not_found_naming_it(self, store: Store) -> None:
        with pytest.raises(FileNotFoundError, match=named("no/such")):
            run_sync(store.get("no/such"))

    @pytest.mark.parametrize(("start", "end"), [(0, 1), (1, 4), (300, 9000), (0, len(BLOB)),
                                                (len(BLOB) - 1, len(BLOB))])
    def test_get_range(self, store: Store, start: int, end: int) -> None:
        self.write(store, "f", BLOB)
        assert bytes(run_sync(store.get_range("f", start, end))) == BLOB[start:end]

    def test_get_range_counts_the_bytes_read(self, store: Store) -> None:
        self.write(store, "f", BLOB)
        before = store.stats.bytes_read
        run_sync(store.get_range("f", 10, 110))
        assert store.stats.bytes_read - before == 100

    def test_get_range_of_a_missing_file_names_it(self, store: Store) -> None:
        with pytest.raises(FileNotFoundError, match=named("no/such")):
            run_sync(store.get_range("no/such", 0, 4))

    def test_read_into_fills_every_destination(self, store: Store) -> None:
        self.write(store, "f", BLOB)
        spans = [(0, 10), (12, 3), (5000, 4000), (10_000, 240), (100, 1)]
        reads = [ReadInto(s, memoryview(bytearray(n))) for s, n in spans]
        run_sync(store.read_into("f", reads))
        assert [bytes(r.dest) for r in reads] == [BLOB[s : s + n] for s, n in spans]

    def test_read_into_past_the_end_raises_naming_the_file(self, store: Store) -> None:
        self.write(store, "short", BLOB[:100])
        with pytest.raises(EOFError, match=named("short")):
            run_sync(store.read_into("short", [ReadInto(90, memoryview(bytearray(20)))]))

    def test_read_files_returns_each_files_error_or_none(self, store: Store) -> None:
        self.write(store, "g/one", BLOB[:50])
        self.write(store, "g/two", BLOB[50:80])
        one, two, gone = (memoryview(bytearray(n)) for n in (50, 10, 4))
        got = run_sync(store.read_files([("g/one", [ReadInto(0, one)]),
                                         ("g/two", [ReadInto(20, two)]),
                                         ("g/gone", [ReadInto(0, gone)])]))
        assert got[:2] == [None, None] and isinstance(got[2], FileNotFoundError)
        assert bytes(one) == BLOB[:50] and bytes(two) == BLOB[70:80]

    # -- writing ---------------------------------------------------------------------------
    def test_put_writes_the_parts_concatenated(self, store: Store) -> None:
        self.writable(store)
        parts: Sequence[bytes | bytearray | memoryview] = (
            BLOB[:7], bytearray(BLOB[7:4000]), memoryview(BLOB)[4000:], b"")
        run_sync(store.put("x/y", parts))
        assert bytes(run_sync(store.get("x/y"))) == BLOB

    def test_put_overwrites(self, store: Store) -> None:
        self.writable(store)
        run_sync(store.put("f", [BLOB]))
        run_sync(store.put("f", [b"short"]))
        assert bytes(run_sync(store.get("f"))) == b"short"

    def test_put_takes_streamed_parts_when_it_says_so(self, store: Store) -> None:
        self.writable(store)
        if not store.streams_parts:
            pytest.skip("the store does not take streamed parts")
        run_sync(store.put("s", [BLOB[:10], Pieces(BLOB[10:], 999)]))
        assert bytes(run_sync(store.get("s"))) == BLOB

    def test_put_files_writes_each_file(self, store: Store) -> None:
        self.writable(store)
        files = {f"many/{i}": BLOB[i : 3 * i + 1] for i in range(20)}
        run_sync(store.put_files([(p, [d]) for p, d in files.items()]))
        assert {p: bytes(run_sync(store.get(p))) for p in files} == files

    def test_put_if_absent_creates_once(self, store: Store) -> None:
        self.writable(store)
        run_sync(store.put_if_absent("index", b"first"))
        with pytest.raises(FileExistsError, match=named("index")):
            run_sync(store.put_if_absent("index", b"second"))
        assert bytes(run_sync(store.get("index"))) == b"first"

    def test_holds_tells_equal_bytes(self, store: Store) -> None:
        self.write(store, "h", b"same")
        assert run_sync(store.holds("h", b"same"))
        assert not run_sync(store.holds("h", b"other"))
        assert not run_sync(store.holds("missing", b"same"))

    # -- namespace -------------------------------------------------------------------------
    def test_exists_and_size(self, store: Store) -> None:
        self.write(store, "d/f", BLOB[:123])
        assert run_sync(store.exists("d/f")) and not run_sync(store.exists("d/g"))
        assert run_sync(store.size("d/f")) == 123

    def test_size_of_a_missing_file_names_it(self, store: Store) -> None:
        with pytest.raises(FileNotFoundError, match=named("no/such")):
            run_sync(store.size("no/such"))

    def test_version_tag_changes_when_the_file_is_rewritten(self, store: Store) -> None:
        self.writable(store)
        run_sync(store.put("t", [b"abc"]))
        first = run_sync(store.version_tag("t"))
        run_sync(store.put("t", [b"abcdef"]))
        assert run_sync(store.version_tag("t")) != first

    def test_list_is_recursive_and_relative_to_the_root(self, store: Store) -> None:
        if not store.supports_listing:
            pytest.skip("the store does not list")
        for p in ("top", "d/a", "d/e/b", "dz/c"):
            self.write(store, p, b"1")
        assert sorted(run_sync(store.list())) == ["d/a", "d/e/b", "dz/c", "top"]
        assert sorted(run_sync(store.list("d"))) == ["d/a", "d/e/b"]
        assert run_sync(store.list("nothing/here")) == []

    def test_delete_removes_and_ignores_missing_files(self, store: Store) -> None:
        self.writable(store)
        if not store.supports_deletes:
            pytest.skip("the store does not delete")
        run_sync(store.put("del/a", [b"1"]))
        run_sync(store.put("del/b", [b"2"]))
        run_sync(store.delete(["del/a", "del/never"]))
        assert not run_sync(store.exists("del/a")) and run_sync(store.exists("del/b"))

    @pytest.mark.parametrize("path", ["../outside", "a/../../outside", "/abs/outside"])
    def test_paths_leaving_the_root_are_refused(self, store: Store, path: str) -> None:
        with pytest.raises(MalformedIndexError, match=named(path)):
            run_sync(store.get(path))

    # -- read-only -------------------------------------------------------------------------
    def test_a_read_only_store_refuses_every_write_naming_the_path(self, store: Store) -> None:
        self.write(store, "kept", b"old")
        view = store if store.read_only else ReadOnlyStore(store)
        assert view.read_only
        refused = [view.put("kept", [b"new"]), view.put_files([("kept", [b"new"])]),
                   view.put_if_absent("fresh", b"new"), view.delete(["kept"])]
        for attempt, path in zip(refused, ("kept", "kept", "fresh", "kept"), strict=True):
            with pytest.raises(ReadOnlyStoreError, match=named(path)) as err:
                run_sync(attempt)
            assert store.url.rstrip("/") in str(err.value)
        assert bytes(run_sync(view.get("kept"))) == b"old"
        assert not run_sync(view.exists("fresh"))
