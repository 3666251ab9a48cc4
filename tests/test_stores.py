"""Every built-in store passes ``ckptfs.testing.store_tests.StoreTests``: local files, fsspec's
memory filesystem, S3 through s3fs and through obstore (moto's server), and the stores that
forward to others (a folder of a store, a read-only view, the routed store of a restore)."""

from __future__ import annotations

import uuid

import pytest

import ckptfs
from ckptfs.errors import ReadOnlyStoreError
from ckptfs.io import ReadInto, ReadOnlyStore, Store, StoreOptions, open_store, run_sync
from ckptfs.io.prefixed import PrefixedStore
from ckptfs.io.routed import RoutedStore
from ckptfs.testing.store_tests import StoreTests

#: the store settings that pick obstore for s3:// (every other setting at its default)
OBSTORE = StoreOptions(client="obstore")


def opened(url: str, storage_options: dict | None = None, options: StoreOptions | None = None):
    """The store at ``url``, closed after the test."""
    store = run_sync(open_store(url, storage_options, options))
    yield store
    run_sync(store.close())


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        yield from opened(str(tmp_path / "root"))


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self):
        yield from opened(f"memory://store-tests/{uuid.uuid4().hex}")


class TestS3fsStore(StoreTests):
    @pytest.fixture
    def store(self, s3):
        yield from opened(f"{s3.url}/{uuid.uuid4().hex}", s3.options)


class TestObstoreStore(StoreTests):
    @pytest.fixture
    def store(self, s3):
        yield from opened(f"{s3.url}/{uuid.uuid4().hex}", s3.options, OBSTORE)


class TestPrefixedStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        for base in opened(str(tmp_path / "root")):
            run_sync(base.put("beside/other", [b"not in the folder"]))
            yield PrefixedStore(base, "step-1")


class TestReadOnlyStore(StoreTests):
    """Reads as its base does; the files are written through the base."""

    @pytest.fixture
    def store(self, tmp_path):
        for base in opened(str(tmp_path / "root")):
            yield ReadOnlyStore(base)

    def write(self, store: Store, path: str, data: bytes) -> None:
        assert isinstance(store, ReadOnlyStore)
        run_sync(store.base.put(path, [data]))


class TestRoutedStore(StoreTests):
    """The paths in ``near_paths`` are read from a local store, the rest from S3: every file is
    written to S3, and its copy to the local store when it is read from there (a local tier
    holds copies of the committed files)."""

    @pytest.fixture
    def store(self, tmp_path, s3):
        for near in opened(str(tmp_path / "near")):
            for far in opened(f"{s3.url}/{uuid.uuid4().hex}", s3.options):
                yield RoutedStore(near, far, {"f", "g/one", "d/f", "d/a", "kept"})

    def write(self, store: Store, path: str, data: bytes) -> None:
        assert isinstance(store, RoutedStore)
        run_sync(store.far.put(path, [data]))
        if path in store.near_paths:
            run_sync(store.near.put(path, [data]))


def test_a_folder_of_a_read_only_store_is_read_only(tmp_path):
    for base in opened(str(tmp_path / "root")):
        folder = PrefixedStore(ReadOnlyStore(base), "step-1")
        assert folder.read_only
        with pytest.raises(ReadOnlyStoreError, match=r"root/step-1/f.*read-only"):
            run_sync(folder.put("f", [b"x"]))
        assert not (tmp_path / "root" / "step-1").exists()


def test_a_refused_write_is_a_storage_error_and_a_permission_error(tmp_path, s3):
    """What callers caught before the routed store had a read-only flag still catches it, and
    the public error boundary lets it through as it is."""
    from ckptfs.engine.errors import translate

    for near in opened(str(tmp_path / "near")):
        for far in opened(f"{s3.url}/{uuid.uuid4().hex}", s3.options):
            routed = RoutedStore(near, far, {"a"})
            with pytest.raises(PermissionError) as err:
                run_sync(routed.delete(["a", "b"]))
            assert isinstance(err.value, ckptfs.StorageError)
            assert translate(err.value, routed.url) is err.value
            assert str(err.value).startswith(f"{near.full_path('a')}: the store {far.url} ")


def test_routed_reads_keep_each_sides_group_and_stats(tmp_path):
    """A routed ``read_files`` hands each store its own files as one group; the routed store's
    stats are the sums of both sides'."""
    for near in opened(str(tmp_path / "near")):
        for far in opened(str(tmp_path / "far")):
            for store, names in ((near, ("n1", "n2")), (far, ("f1",))):
                for n in names:
                    run_sync(store.put(n, [n.encode()]))
            calls: dict[str, list[list[str]]] = {"near": [], "far": []}
            for side, store in (("near", near), ("far", far)):
                spy_read_files(store, calls[side])
            routed = RoutedStore(near, far, {"n1", "n2"})
            dests = {n: memoryview(bytearray(2)) for n in ("n1", "f1", "n2")}
            got = run_sync(routed.read_files([(n, [ReadInto(0, d)]) for n, d in dests.items()]))
            assert got == [None] * 3 and {n: bytes(d) for n, d in dests.items()} == \
                {n: n.encode() for n in dests}
            assert calls == {"near": [["n1", "n2"]], "far": [["f1"]]}
            assert routed.stats.bytes_read == near.stats.bytes_read + far.stats.bytes_read == 6


def spy_read_files(store: Store, calls: list[list[str]]) -> None:
    real = store.read_files

    async def spy(items):
        calls.append([p for p, _ in items])
        return await real(items)

    store.read_files = spy  # type: ignore[method-assign]  # a spy on this one store
