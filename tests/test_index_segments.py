"""Index segments (formats/README.md §2.6), the engine's side: a segmented save on 8 spawned gloo
ranks whose entries travel to several segment owners, loaded bit-exact at 1, 3, 5 and 8 ranks
into DTensors and flat ZeRO-style slices; a rank reads only the byte ranges of the blocks its
targets overlap (a counting store), on local files and on S3 (moto, ranged reads); a missing
or damaged segment fails the load naming it, before any target changes; a save killed after
writing its segment leaves no root and the checkpoint beside it intact; and who decides
segmented or whole."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import signal

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptfs
from ckptfs.engine.index_io import read_root, read_rows
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.hooks import SaveHook
from ckptfs.errors import CheckpointNotFoundError, CkptfsError, ConfigError, IntegrityError
from ckptfs.io import open_store, run_sync
from ckptfs.io.wrapper import WrapperStore
from ckptfs.layout.boxes import Box
from ckptfs.layout.index import INDEX_FILE
from ckptfs.testing.ranks import run_ranks

#: several owners among 8 ranks: segments of about this many rows
ROWS = 4
SEGMENTED = SaveOptions(index_segments=True, segment_rows=ROWS)
LAYERS = 8
FLAT = 1000  #: elements of the flat (ZeRO-style) optimizer state


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ref = {"w": torch.randn(64, 16, generator=g), "c": torch.randn(16, 48, generator=g),
           "plain": torch.randn(5, 3, generator=g), "flat": torch.randn(FLAT, generator=g)}
    for i in range(LAYERS):
        ref[f"l{i}"] = torch.randn(24, 4, generator=g).to(torch.bfloat16)
    return ref


def _bounds(n: int, world: int, uneven: bool) -> list[tuple[int, int]]:
    """Rank slices of ``n`` elements: even, or rank r taking r+1 parts (ZeRO's flat buffers)."""
    weights = list(range(1, world + 1)) if uneven else [1] * world
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + round(n * w / sum(weights)))
    cuts[-1] = n
    return list(itertools.pairwise(cuts))


def state(rank: int, world: int, *, fill: bool, rows: bool = True) -> dict:
    """This rank's view: DTensors on a 1-D mesh (``rows``: w Shard(0), c Shard(1); otherwise
    the other way round), the layers Shard(0), a flat slice, a replicated plain tensor."""
    ref = reference()
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    def d(t: torch.Tensor, p) -> torch.Tensor | DTensor:
        if mesh is None:
            return t.clone() if fill else torch.zeros_like(t)
        x = distribute_tensor(t, mesh, [p])
        return x if fill else torch.zeros_like(x)

    lo, hi = _bounds(FLAT, world, uneven=fill)[rank]
    flat = ref["flat"][lo:hi].clone() if fill else torch.zeros(hi - lo)
    return {
        "model": {"w": d(ref["w"], Shard(0) if rows else Shard(1)),
                  "c": d(ref["c"], Shard(1) if rows else Replicate()),
                  "layers": [d(ref[f"l{i}"], Shard(0)) for i in range(LAYERS)]},
        "optim": {"flat": ckptfs.ShardedTensor(flat, (FLAT,), (lo,)), "step": 9 if fill else 0},
        "plain": ref["plain"].clone() if fill else torch.zeros(5, 3),
    }


def _full(t) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(got: dict, rank: int, world: int) -> None:
    """``got`` (filled by a load) equals the reference, bit for bit."""
    ref = reference()
    assert torch.equal(_full(got["model"]["w"]), ref["w"])
    assert torch.equal(_full(got["model"]["c"]), ref["c"])
    for i in range(LAYERS):
        assert torch.equal(_full(got["model"]["layers"][i]), ref[f"l{i}"]), i
    lo, hi = _bounds(FLAT, world, uneven=False)[rank]
    assert torch.equal(got["optim"]["flat"].local_tensor, ref["flat"][lo:hi])
    assert torch.equal(got["plain"], ref["plain"]) and got["optim"]["step"] == 9


def _gathered(save) -> tuple[int, int, int]:
    """Run ``save()`` recording what ``Comm.gather`` and ``Comm.settle_gather`` bring the
    coordinator: (index entries, segment reports, entry bytes counted)."""
    from ckptfs.dist import comm as comm_module

    real, real_settle = comm_module.Comm.gather, comm_module.Comm.settle_gather
    seen: list = []

    def spy(self, obj, what="a gather", *, entries=False):
        out = real(self, obj, what, entries=entries)
        seen.extend(out or ())
        return out

    def settle_spy(self, what, err, obj, **kw):
        said, out = real_settle(self, what, err, obj, **kw)
        seen.extend(out or ())
        return said, out

    comm_module.Comm.gather = spy  # type: ignore[method-assign]
    comm_module.Comm.settle_gather = settle_spy  # type: ignore[method-assign]
    try:
        result = save()
    finally:
        comm_module.Comm.gather = real  # type: ignore[method-assign]
        comm_module.Comm.settle_gather = real_settle  # type: ignore[method-assign]
    rows = sum(len(getattr(o, "entries", ())) for o in seen)
    parts = sum(len(getattr(o, "segments", ())) for o in seen)
    return rows, parts, result.comm.entry_bytes


def save_world(rank: int, world: int, root: str) -> None:
    """Segmented and whole saves of the same state, recording what the coordinator gathered;
    then a load back in another layout."""
    sd = state(rank, world, fill=True)
    seg = _gathered(lambda: ckptfs.save(sd, f"{root}/seg", options=SEGMENTED))
    whole = _gathered(lambda: ckptfs.save(sd, f"{root}/whole",
                                          options=SaveOptions(index_segments=False)))
    got = state(rank, world, fill=False, rows=False)
    ckptfs.load(got, f"{root}/seg")
    check(got, rank, world)
    with open(os.path.join(root, f"gathered{rank}.json"), "w") as f:
        json.dump({"seg": seg, "whole": whole}, f)


def load_world(rank: int, world: int, root: str) -> None:
    got = state(rank, world, fill=False)
    res = ckptfs.load(got, f"{root}/seg")
    check(got, rank, world)
    assert not res.missing_keys and not res.unexpected_keys
    if world == 3:  # saved again segmented by the writer processes (collectives over the pipe)
        ckptfs.async_save(got, f"{root}/again", options=SEGMENTED,
                          writer="process").result(timeout=600)
        again = state(rank, world, fill=False, rows=False)
        ckptfs.load(again, f"{root}/again")
        check(again, rank, world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("segments"))
    run_ranks(8, save_world, root)
    return root


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test of the module's spawned 8-rank save
def test_eight_ranks_write_several_segments_and_the_coordinator_gets_no_entries(saved):
    root = json.loads(open(os.path.join(saved, "seg", INDEX_FILE)).read())
    assert "index_segments" in root["required_features"]
    assert len(root["segments"]) >= 4  # several owners
    assert all("chunks" not in t for t in root["tensors"].values())
    owners = {p.rsplit("/", 1)[1] for p in root["segments"]}
    assert len(owners) == len(root["segments"])
    got = json.load(open(os.path.join(saved, "gathered0.json")))
    # what the coordinator gathered: files and the owners' reports, not one chunk row
    assert got["seg"][:2] == [0, len(root["segments"])], got
    assert got["whole"][0] >= 8 * (LAYERS + 3) and got["whole"][1] == 0, got
    report = ckptfs.verify(f"{saved}/seg")
    assert report.ok, report.problems


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [3, 5])
def test_a_segmented_checkpoint_of_eight_ranks_loads_at_another_world(saved, world):
    run_ranks(world, load_world, saved)
    if world == 3:
        root = json.loads(open(os.path.join(saved, "again", INDEX_FILE)).read())
        assert len(root["segments"]) >= 2


@pytest.mark.slow
def test_it_loads_in_one_process_and_whole(saved):
    got = state(0, 1, fill=False)
    ckptfs.load(got, f"{saved}/seg")
    check(got, 0, 1)
    keys = ckptfs.load_keys(f"{saved}/seg", ["model/w", "optim/flat"])
    assert torch.equal(keys["model"]["w"], reference()["w"])
    assert torch.equal(keys["optim"]["flat"], reference()["flat"])


# -- what a rank reads ---------------------------------------------------------------------------

class Counting(WrapperStore):
    """Records each read: (path, start, end) (end None: the whole file)."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.reads: list[tuple[str, int, int | None]] = []

    async def get(self, path: str):
        self.reads.append((path, 0, None))
        return await self.base.get(path)

    async def get_range(self, path: str, start: int, end: int):
        self.reads.append((path, start, end))
        return await self.base.get_range(path, start, end)


#: a tensor of 512 chunks (zarr cuts each rank's rows into 1 KiB chunks): 8 blocks of 64 rows
TALL = (8192, 16)
ZARR = {"backend": "zarr", "backend_version": 2, "backend_options": {"max_chunk_bytes": 1024}}


def tall_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"tall": torch.randn(TALL, generator=g), "other": torch.randn(TALL, generator=g)}


def _reads_of(url: str, wanted: dict[str, list[Box]], storage_options=None):
    async def go():
        store = await open_store(url, storage_options)
        try:
            root = await read_root(store)
            counting = Counting(store)
            part = await read_rows(counting, root, wanted)
            return root, part, counting.reads
        finally:
            await store.close()

    return run_sync(go())


def _blocks_read(root, reads, key: str) -> list:
    seg = {p: i for i, p in enumerate(root.segments)}
    return [b for b in root.tensors[key].blocks
            if any(seg[p] == b.segment and lo <= b.byte_offset and b.byte_offset
                   + b.byte_length <= hi for p, lo, hi in reads)]


def test_a_rank_reads_only_the_blocks_its_region_overlaps(tmp_path):
    url = str(tmp_path / "tall")
    ckptfs.save(tall_state(), url, options=SEGMENTED, **ZARR)
    rows = Box((1000, 0), (100, 16))  # within the block of rows [512, 1024) .. [1024, 1536)
    root, part, reads = _reads_of(url, {"tall": [rows]})
    blocks = root.tensors["tall"].blocks
    assert len(blocks) == 8 and len(root.tensors["other"].blocks) == 8
    need = [b for b in blocks if b.overlaps(rows)]
    assert 1 <= len(need) <= 2
    assert all(p in root.segments and hi is not None for p, _, hi in reads)  # ranged reads
    # the blocks' bytes and the newline between two neighbours, nothing else
    assert sum(hi - lo for _, lo, hi in reads) <= sum(b.byte_length + 1 for b in need)
    assert _blocks_read(root, reads, "tall") == need and not _blocks_read(root, reads, "other")
    # the rows read hold the region, and only the chunks of those blocks
    assert 0 < len(part.tensors["tall"].chunks) <= 64 * len(need)
    assert part.tensors["other"].chunks == ()
    # a load of that region reads the same and fills it exactly
    target = {"tall": ckptfs.ShardedTensor(torch.zeros(100, 16), TALL, (1000, 0))}
    ckptfs.load(target, url, strict=False)
    assert torch.equal(target["tall"].local_tensor, tall_state()["tall"][1000:1100])


@pytest.mark.slow
def test_on_s3_a_load_reads_its_blocks_with_ranged_requests(s3):
    from tests.s3_fixtures import proxy_log

    url = f"{s3.url}/tall"
    # one tensor is enough: 512 chunks, so 8 blocks of index rows, with half the PUTs of two
    state = {"tall": tall_state()["tall"]}
    ckptfs.save(state, url, storage_options=s3.options, options=SEGMENTED, **ZARR)
    before = len(proxy_log(s3.endpoint))
    target = {"tall": ckptfs.ShardedTensor(torch.zeros(100, 16), TALL, (5000, 0))}
    ckptfs.load(target, url, storage_options=s3.options, strict=False)
    assert torch.equal(target["tall"].local_tensor, tall_state()["tall"][5000:5100])
    gets = [r for r in proxy_log(s3.endpoint)[before:] if r.method == "GET" and "/index/" in r.path]
    assert gets and all(r.range.startswith("bytes=") for r in gets), gets
    root = run_sync(_root(url, s3.options))
    size = root.files[root.segments[0]]
    got = sum(int(b) - int(a) + 1 for a, b in (r.range[6:].split("-") for r in gets))
    assert got * 4 < size, (got, size)


async def _root(url: str, options):
    store = await open_store(url, options)
    try:
        return await read_root(store)
    finally:
        await store.close()


# -- damage -----------------------------------------------------------------------------------

def _segmented(tmp_path) -> tuple[str, list[str]]:
    url = str(tmp_path / "ck")
    ckptfs.save(tall_state(), url, options=SEGMENTED, **ZARR)
    root = json.loads(open(os.path.join(url, INDEX_FILE)).read())
    return url, root["segments"]


def _zeros() -> dict:
    return {k: torch.zeros(TALL) for k in ("tall", "other")}


def test_a_missing_segment_fails_the_load_naming_it(tmp_path):
    url, segments = _segmented(tmp_path)
    os.remove(os.path.join(url, segments[0]))
    target = _zeros()
    with pytest.raises(CheckpointNotFoundError, match=segments[0]):
        ckptfs.load(target, url)
    assert all(not t.any() for t in target.values())  # nothing loaded
    report = ckptfs.verify(url)
    assert not report.ok and any(segments[0] in p.message or p.file == segments[0]
                                 for p in report.problems), report.problems


def test_a_damaged_segment_fails_the_load_naming_it(tmp_path):
    url, segments = _segmented(tmp_path)
    path = os.path.join(url, segments[0])
    raw = bytearray(open(path, "rb").read())
    at = next(i for i, c in enumerate(raw) if chr(c).isdigit())  # the first row's first offset
    raw[at] = ord("7") if raw[at] != ord("7") else ord("8")
    open(path, "wb").write(bytes(raw))
    target = _zeros()
    with pytest.raises(IntegrityError, match=segments[0]):
        ckptfs.load(target, url)
    assert all(not t.any() for t in target.values())


# -- a killed save ----------------------------------------------------------------------------

def _killed_child(url: str) -> None:
    """Save segmented to ``url``; SIGKILL this process right after the segment is written."""
    from ckptfs.engine.save import pipeline

    real = pipeline.open_store

    async def opened(*a, **kw):
        store = await real(*a, **kw)
        put = store.put

        async def put_then_die(path, parts):
            await put(path, parts)
            if path.startswith("index/"):
                os.kill(os.getpid(), signal.SIGKILL)

        store.put = put_then_die
        return store

    pipeline.open_store = opened
    ckptfs.save(tall_state(), url, options=SEGMENTED, **ZARR)
    os._exit(0)  # not reached: the save writes a segment


@pytest.mark.slow
def test_a_save_killed_after_its_segment_leaves_no_root_and_the_previous_checkpoint(tmp_path):
    prev = str(tmp_path / "prev")
    ckptfs.save(tall_state(), prev, options=SEGMENTED, **ZARR)
    url = str(tmp_path / "killed")
    p = mp.get_context("spawn").Process(target=_killed_child, args=(url,))
    p.start()
    p.join(300)
    assert p.exitcode == -signal.SIGKILL
    assert os.listdir(os.path.join(url, "index"))  # the segment was written ...
    assert not os.path.exists(os.path.join(url, INDEX_FILE))  # ... and no root
    with pytest.raises(CheckpointNotFoundError):
        ckptfs.load(_zeros(), url)
    got = _zeros()
    ckptfs.load(got, prev)
    assert all(torch.equal(got[k], v) for k, v in tall_state().items())
    assert ckptfs.verify(prev).ok
    ckptfs.clean(url)
    assert not os.path.exists(os.path.join(url, "index")) or not any(
        files for _, _, files in os.walk(os.path.join(url, "index")))


# -- segmented or whole -----------------------------------------------------------------------

def _features(url: str) -> list[str]:
    return json.loads(open(os.path.join(url, INDEX_FILE)).read())["required_features"]


def test_small_saves_stay_whole_and_true_forces_segments(tmp_path):
    sd = {"a": torch.arange(10.0), "b": torch.ones(3, 3)}
    ckptfs.save(sd, tmp_path / "small")
    assert "index_segments" not in _features(str(tmp_path / "small"))
    ckptfs.save(sd, tmp_path / "forced", options=SaveOptions(index_segments=True))
    assert "index_segments" in _features(str(tmp_path / "forced"))
    got = ckptfs.load_keys(tmp_path / "forced")
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["b"], sd["b"])


def test_segments_with_content_hashes_are_chunk_objects(tmp_path):
    sd = {"a": torch.arange(10.0)}
    url = str(tmp_path / "hashed")
    ckptfs.save(sd, url, options=SaveOptions(index_segments=True, hashes=True))
    root = json.loads(open(os.path.join(url, INDEX_FILE)).read())
    assert "packed_chunks" not in root["required_features"]
    raw = open(os.path.join(url, root["segments"][0]), "rb").read()
    assert b'"hash": "xxh3-128:' in raw
    # a delta save on it writes its index whole (its references name the base)
    ckptfs.save(sd, tmp_path / "delta", options=SaveOptions(base=url))
    assert "index_segments" not in _features(str(tmp_path / "delta"))


def test_a_backend_whose_final_files_need_every_chunk_refuses_forced_segments(tmp_path):
    with pytest.raises(ConfigError, match="index_segments"):
        ckptfs.save({"a": torch.ones(4)}, tmp_path / "dcp", backend="torch_dist",
                     options=SaveOptions(index_segments=True))
    assert not os.path.exists(tmp_path / "dcp" / INDEX_FILE)


def test_save_options_check_the_segment_fields():
    with pytest.raises(ConfigError, match="index_segments"):
        SaveOptions(index_segments="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="segment_rows"):
        SaveOptions(segment_rows=0)



def test_fingerprints_of_a_segmented_save_are_in_its_root(tmp_path):
    sd = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([1.0, float("inf")])}
    url = str(tmp_path / "stats")
    ckptfs.save(sd, url, options=SaveOptions(index_segments=True), stats=True)
    root = json.loads(open(os.path.join(url, INDEX_FILE)).read())
    assert "index_segments" in root["required_features"]
    index = ckptfs.load_metadata(url)
    a, b = index.tensors["a"].stats, index.tensors["b"].stats
    assert a is not None and a.count == 12 and a.max == 11.0 and a.min == 0.0
    assert b is not None and b.inf == 1


class _RefuseAtCommit(SaveHook):
    def before_commit(self, index, parts, note):
        raise CkptfsError("refused at commit")


def test_a_failed_commit_removes_the_segments_with_the_data_files(tmp_path):
    from ckptfs.engine.save.pipeline import run_save
    from ckptfs.save import save_request

    url = str(tmp_path / "refused")
    request = save_request(url, "safetensors_chunks", None, None, None, None, False, False,
                           SEGMENTED, check_finite=None, stats=None, host_memory_limit=None)
    request = dataclasses.replace(request, hooks=(*request.hooks, _RefuseAtCommit()))
    with pytest.raises(CkptfsError, match="refused at commit"):
        run_save({"a": torch.ones(64, 8), "b": torch.zeros(3)}, request, None)
    left = [os.path.relpath(os.path.join(d, f), url) for d, _, fs in os.walk(url) for f in fs]
    assert left == [], left  # no data file, no segment, no root, the lock given back
