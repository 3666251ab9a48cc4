"""Every built-in store passes ``ckptfs.testing.store_tests.StoreTests``: local files, fsspec's
memory filesystem, S3 through s3fs and through obstore (moto's server), and the stores that
forward to others (a folder of a store, a read-only view, the routed store of a restore)."""

from __future__ import annotations

import uuid

import pytest

from ckptfs.io import IOConfig, ReadOnlyStore, Store, open_store, run_sync
from ckptfs.io.prefixed import PrefixedStore
from ckptfs.io.routed import RoutedStore
from ckptfs.testing.store_tests import StoreTests

#: the store settings that pick obstore for s3:// (every other setting at its default)
OBSTORE = IOConfig(engine="obstore")


def opened(url: str, storage_options: dict | None = None, config: IOConfig | None = None):
    """The store at ``url``, closed after the test."""
    store = run_sync(open_store(url, storage_options, config))
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
