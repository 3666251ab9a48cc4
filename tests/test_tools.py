"""The tools: ``ckptfs inspect | verify | convert | unshard | bench`` from the command line
and ``ckptfs.verify / convert / unshard`` from Python, on real checkpoints of every built-in
backend and on foreign ones (DCP, Megatron-Core torch_dist and zarr, Hugging Face), locally and
on S3 (moto)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptfs
from ckptfs.cli import main, parse_size, storage_options
from ckptfs.io import open_store, run_sync
from ckptfs.testing.conformance.cases import assert_same, basic_state, differences, flatten
from tests.test_torch_dist import _megatron_dir
from tests.test_zarr import MEGATRON_COMMON, build_megatron, megatron_tensors

WRITABLE = [("safetensors_chunks", 1), ("zarr", 2), ("zarr", 3), ("torch_dist", 1)]
REF = basic_state()
ROOT = Path(__file__).resolve().parent.parent


def hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"model.embed.weight": torch.randn(11, 4, generator=g),
            "model.layers.0.w": torch.randn(4, 4, generator=g).to(torch.bfloat16),
            "model.layers.0.b": torch.randn(4, generator=g), "lm_head.weight": torch.randn(11, 4, generator=g)}


def write_hf(root: Path) -> None:
    """The sharded Hugging Face layout, as huggingface_hub / transformers write it."""
    root.mkdir(parents=True)
    sd = hf_state()
    shards = {"model-00001-of-00002.safetensors": ["model.embed.weight", "model.layers.0.w"],
              "model-00002-of-00002.safetensors": ["model.layers.0.b", "lm_head.weight"]}
    for name, keys in shards.items():
        save_file({k: sd[k] for k in keys}, root / name, metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in sd.values())},
         "weight_map": {k: n for n, ks in shards.items() for k in ks}}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """name -> (root, expected whole state): every writable backend and four foreign layouts."""
    root = tmp_path_factory.mktemp("tools")
    out = {}
    for name, version in WRITABLE:
        p = root / f"{name}-{version}"
        ckptfs.save(REF, p, backend=name, backend_version=version)
        out[f"{name}-{version}"] = (p, REF)
    dcp_sd = {"w": torch.randn(6, 5), "opt": {"step": torch.tensor(3), "lr": 0.5}}
    dcp.save(dcp_sd, checkpoint_id=str(root / "dcp"), no_dist=True)
    out["dcp"] = (root / "dcp", dcp_sd)
    d, w = _megatron_dir(root, {"iteration": 7})
    out["megatron-torch_dist"] = (d, {"decoder.w": w, "decoder.b": torch.arange(4), "iteration": 7})
    build_megatron(str(root / "megatron-zarr"))
    out["megatron-zarr"] = (root / "megatron-zarr", {**megatron_tensors(), **MEGATRON_COMMON})
    write_hf(root / "hf")
    out["hf"] = (root / "hf", hf_state())
    return out


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---------------------------------------------------------------------------- inspect
def test_inspect_every_backend_and_foreign_layout(ckpts, capsys):
    for name, (root, expected) in ckpts.items():
        rc, out, _ = cli(capsys, "inspect", root, "--json")
        assert rc == 0, name
        doc = json.loads(out)
        meta = ckptfs.load_metadata(root)
        tensors, values, _ = flatten(expected)
        assert {t["key"] for t in doc["tensors"]} == set(tensors) == set(meta.tensors), name
        assert set(doc["values"]) == set(values), name
        for t in doc["tensors"]:
            want = tensors[t["key"]]
            assert (t["shape"], t["bytes"]) == (list(want.shape), want.nbytes), (name, t)
            assert t["chunks"] == len(meta.tensors[t["key"]].chunks)
        assert doc["backend"]["name"] == meta.backend and doc["foreign"] == (not name[-1].isdigit())
        assert doc["totals"]["file_bytes"] == meta.total_bytes
        rc, text, _ = cli(capsys, "inspect", root)
        assert rc == 0 and f"backend {meta.backend}-{meta.backend_version}" in text
        assert all(k in text for k in tensors), name


def test_inspect_selects_keys_and_reads_no_data(ckpts, capsys, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(ckpts["safetensors_chunks-1"][0], root)
    for f in ckptfs.load_metadata(root).files:
        (root / f).unlink()  # the index alone is enough
    rc, out, _ = cli(capsys, "inspect", root, "--json", "--keys", "dtypes/float*")
    doc = json.loads(out)
    assert rc == 0 and sorted(t["key"] for t in doc["tensors"]) == \
        ["dtypes/float16", "dtypes/float32", "dtypes/float64", "dtypes/float8_e4m3fn", "dtypes/float8_e5m2"]
    rc, out, _ = cli(capsys, "inspect", root, "--keys", "values/int_keys")
    assert rc == 0 and "values/int_keys/0 = 'zero'" in out and "dtypes/" not in out
    rc, _, err = cli(capsys, "inspect", tmp_path / "nothing")
    assert rc == 1 and "CheckpointNotFoundError" in err


# ---------------------------------------------------------------------------- verify
def test_verify_every_backend_and_foreign_layout(ckpts, capsys):
    for name, (root, _) in ckpts.items():
        rc, out, _ = cli(capsys, "verify", root, "--json", "--quiet")
        doc = json.loads(out)
        assert rc == 0 and doc["ok"] and doc["problems"] == [], (name, doc["problems"])
        meta = ckptfs.load_metadata(root)
        chunks = sum(len(t.chunks) for t in meta.tensors.values())
        assert doc["chunks_checksummed"] + doc["chunks_without_checksum"] == chunks, name
        if name[-1].isdigit():  # ckptfs wrote it: every chunk has a crc32c
            assert doc["chunks_checksummed"] == chunks > 0 and doc["skipped"] == []


def test_verify_reports_every_problem(ckpts, capsys, tmp_path):
    """One damaged checkpoint, eight kinds of damage: all are reported, each naming its key,
    chunk and file; exit status 3."""
    state = {f"t{i}": torch.arange(i * 10, i * 10 + 8, dtype=torch.float32) for i in range(6)}
    root = tmp_path / "c"
    ckptfs.save(state, root, backend_options={"max_file_bytes": 40})  # about one tensor per file
    doc = json.loads((root / ckptfs.INDEX_FILE).read_text())
    t = doc["tensors"]
    f = {k: t[k]["chunks"][0]["file"] for k in t}
    assert len(set(f.values())) == 6
    data = bytearray((root / f["t0"]).read_bytes())  # t0: one flipped bit
    data[t["t0"]["chunks"][0]["byte_offset"] + 5] ^= 0x10
    (root / f["t0"]).write_bytes(data)
    (root / f["t1"]).unlink()  # t1: its file is gone
    (root / f["t2"]).write_bytes((root / f["t2"]).read_bytes()[:-4])  # t2: truncated
    t["t3"]["chunks"][0]["offsets"] = [2]  # t3: out of bounds (and so a hole)
    t["t4"]["chunks"].append(dict(t["t4"]["chunks"][0], offsets=[4], shape=[4]))  # t4: overlap
    t["t5"]["chunks"] = []  # t5: a hole
    doc["writer"]["world_size"] = 0  # against the schema (minimum 1), harmless to readers
    del doc["index_checksum"]  # edited by hand: no longer sealed
    (root / ckptfs.INDEX_FILE).write_text(json.dumps(doc))

    report = ckptfs.verify(root)
    got = {(p.kind, p.key, p.chunk, p.file) for p in report.problems}
    assert ("checksum", "t0", (0,), f["t0"]) in got
    assert ("missing-file", None, None, f["t1"]) in got
    assert ("file-size", None, None, f["t2"]) in got and ("read", "t2", (0,), f["t2"]) in got
    assert ("bounds", "t3", (2,), f["t3"]) in got and ("hole", "t3", None, None) in got
    assert ("overlap", "t4", (4,), None) in got
    assert ("read", "t4", (4,), f["t4"]) in got  # the made-up chunk's byte_length is not its own
    assert ("hole", "t5", None, None) in got
    assert ("schema", None, None, ckptfs.INDEX_FILE) in got
    assert ("file-checksum", None, None, f["t0"]) in got  # the flipped bit, seen by the file too
    assert len(report.problems) == 11 and not report.ok, report.problems
    assert "t1" in next(str(p) for p in report.problems if p.kind == "missing-file")
    assert "cover 0 of 8 elements" in next(p.message for p in report.problems if p.key == "t5")
    rc, out, _ = cli(capsys, "verify", root, "--quiet")
    assert rc == 3 and out.count("\n") == 11 and "[checksum] key 't0', chunk [0]" in out
    rc, out, _ = cli(capsys, "verify", root, "--json", "--no-checksums", "--quiet")
    kinds = {p["kind"] for p in json.loads(out)["problems"]}
    assert rc == 3 and "checksum" not in kinds and "missing-file" in kinds


def test_verify_foreign_damage_and_unreadable_index(ckpts, tmp_path):
    root = tmp_path / "hf"
    shutil.copytree(ckpts["hf"][0], root)
    shard = root / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    report = ckptfs.verify(root)
    assert report.foreign and {p.kind for p in report.problems} == {"file-size", "read"}
    meta = ckptfs.load_metadata(root)
    last = max((c.byte_offset, k) for k, t in meta.tensors.items() for c in t.chunks if c.file == shard.name)
    assert [p.key for p in report.problems if p.kind == "read"] == [last[1]]
    (root / ckptfs.INDEX_FILE).write_text("{not json")
    report = ckptfs.verify(root)
    assert [p.kind for p in report.problems] == ["index"] and "not valid JSON" in report.problems[0].message


# ---------------------------------------------------------------------------- convert
def test_convert_every_backend_to_every_other(ckpts, tmp_path):
    for src in WRITABLE:
        for dst in WRITABLE:
            if dst == src:
                continue
            root, expected = ckpts[f"{src[0]}-{src[1]}"]
            out = tmp_path / f"{src[0]}{src[1]}-to-{dst[0]}{dst[1]}"
            res = ckptfs.convert(root, out, backend=dst[0], backend_version=dst[1], buffer_bytes=4096)
            meta = ckptfs.load_metadata(out)
            assert (meta.backend, meta.backend_version) == dst
            assert meta.writer["converted_from"]["backend"] == src[0]
            assert meta.order == ckptfs.load_metadata(root).order  # dict order is kept
            assert res.bytes_written == meta.total_bytes and res.tensors == len(meta.tensors)
            assert_same(ckptfs.load_keys(out), expected, f"{src} -> {dst}")
            assert ckptfs.verify(out).ok


def test_convert_foreign_checkpoints(ckpts, tmp_path, capsys):
    for name in ("dcp", "megatron-torch_dist", "megatron-zarr", "hf"):
        root, expected = ckpts[name]
        out = tmp_path / name
        rc, _, err = cli(capsys, "convert", root, out, "--backend", "zarr:3", "--quiet")
        assert rc == 0, err
        got = ckptfs.load_keys(out)
        assert not differences(got, expected), (name, differences(got, expected)[:3])
        src_chunks = {k: [c.offsets for c in t.chunks] for k, t in ckptfs.load_metadata(root).tensors.items()}
        new_chunks = {k: [c.offsets for c in t.chunks] for k, t in ckptfs.load_metadata(out).tensors.items()}
        assert new_chunks == src_chunks, name  # the source's chunk boxes are kept


def test_convert_refuses_and_cleans_up(ckpts, tmp_path, capsys):
    root, _ = ckpts["safetensors_chunks-1"]
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "convert", root, out, "--backend", "hf_safetensors")
    assert rc == 2 and "hf_safetensors-1 is read-only" in err and not out.exists()
    rc, _, err = cli(capsys, "convert", root, out, "--backend", "zarr:3", "--backend-option", "nope=1")
    assert rc == 2 and "unknown option(s) ['nope']" in err and not out.exists()
    rc, _, err = cli(capsys, "convert", root, out, "--backend", "zarr:x")
    assert rc == 2 and "VERSION must be an integer" in err
    rc, out_json, _ = cli(capsys, "convert", root, out, "--backend", "zarr:2", "--json", "--quiet",
                          "--backend-option", "compressor=zstd", "--backend-option", "level=3")
    assert rc == 0 and json.loads(out_json)["backend"] == "zarr"
    assert ckptfs.load_metadata(out).backend_options["compressor"] == "zstd"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    rc, _, err = cli(capsys, "convert", root, out, "--backend", "torch_dist")
    assert rc == 1 and "CheckpointExistsError" in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before, "nothing was touched"
    # torch_dist refuses a state it cannot represent at commit: nothing is left behind
    bad = tmp_path / "bad"
    ckptfs.save({"d": {0: torch.ones(2), "0": torch.zeros(2)}}, bad)
    with pytest.raises(ckptfs.UnsupportedValueError):
        ckptfs.convert(bad, tmp_path / "bad-td", backend="torch_dist")
    assert not [p for p in (tmp_path / "bad-td").rglob("*") if p.is_file()]


# ---------------------------------------------------------------------------- unshard
def test_unshard_torch(ckpts, tmp_path, capsys):
    root, expected = ckpts["zarr-3"]
    whole = ckptfs.load_keys(root)
    rc, out, err = cli(capsys, "unshard", root, tmp_path / "one", "--format", "torch", "--json", "--quiet")
    assert rc == 0, err
    assert json.loads(out)["files"] == ["checkpoint.pt"]
    assert_same(torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True), expected, "one_file")
    (tmp_path / "ref").mkdir()
    torch.save(whole, tmp_path / "ref" / "checkpoint.pt")  # byte for byte what torch.save writes
    assert (tmp_path / "ref" / "checkpoint.pt").read_bytes() == (tmp_path / "one" / "checkpoint.pt").read_bytes()

    rc, _, err = cli(capsys, "unshard", root, tmp_path / "chunks", "--format", "torch", "--strategy",
                     "chunks", "--chunk-size", "1KB", "--quiet")
    assert rc == 0, err
    merged: dict = {}
    files = sorted((tmp_path / "chunks").iterdir())
    for f in files:
        part = torch.load(f, weights_only=True)
        assert not set(part) & set(merged)
        merged.update(part)
        tensor_bytes = sum(v.nbytes for v in part.values() if isinstance(v, torch.Tensor))
        assert tensor_bytes <= 1000 or sum(isinstance(v, torch.Tensor) for v in part.values()) == 1
    tensors, values, _ = flatten(expected)
    assert len(files) > 3 and set(merged) == set(tensors) | set(values)
    assert_same({k: merged[k] for k in tensors}, tensors, "chunks")

    rc, _, err = cli(capsys, "unshard", root, tmp_path / "per", "--format", "torch", "--strategy",
                     "one_file_per_tensor")
    assert rc == 2 and "no tensor file of their own" in err and "values/" in err
    chosen = ["layout", "keys/a%2Fb%2Fc", "keys/..", "keys/"]  # awkward keys make file names
    rc, _, err = cli(capsys, "unshard", root, tmp_path / "per", "--format", "torch", "--strategy",
                     "one_file_per_tensor", "--keys", *chosen, "--quiet")
    assert rc == 0, err
    want = {k: t for k, t in tensors.items() if any(k == c or k.startswith(c + "/") for c in chosen)}
    assert sorted(p.name for p in (tmp_path / "per").iterdir()) == sorted(f"{quote(k, safe='')}.pt" for k in want)
    for k, t in want.items():
        got = torch.load(tmp_path / "per" / f"{quote(k, safe='')}.pt", weights_only=True)
        assert list(got) == [k] and not differences(got[k], t), k


def test_unshard_every_backend_and_foreign_layout(ckpts, tmp_path):
    for name, (root, expected) in ckpts.items():
        res = ckptfs.unshard(root, tmp_path / name, format="torch", buffer_bytes=1000)
        got = torch.load(tmp_path / name / res.files[0], weights_only=True)
        assert not differences(got, expected), (name, differences(got, expected)[:3])
        tensors = flatten(expected)[0]
        res = ckptfs.unshard(root, tmp_path / f"{name}-st", format="safetensors",
                             keys=list(tensors), strategy="chunks", chunk_size=300)
        merged = {k: v for f in res.files for k, v in load_file(tmp_path / f"{name}-st" / f).items()}
        assert not differences(merged, tensors), name


def test_unshard_safetensors_and_hf(ckpts, tmp_path, capsys):
    root, expected = ckpts["torch_dist-1"]
    rc, _, err = cli(capsys, "unshard", root, tmp_path / "x", "--format", "safetensors")
    assert rc == 2 and "hold tensors only" in err and not (tmp_path / "x").exists()
    dtypes = expected["dtypes"]
    rc, _, err = cli(capsys, "unshard", root, tmp_path / "one", "--keys", "dtypes", "--quiet")
    assert rc == 0, err
    assert not differences(load_file(tmp_path / "one" / "checkpoint.safetensors"), dtypes)
    rc, _, _ = cli(capsys, "unshard", root, tmp_path / "per", "--keys", "dtypes", "--strategy",
                   "one_file_per_tensor", "--quiet")
    assert rc == 0 and sorted(p.name for p in (tmp_path / "per").iterdir()) == \
        sorted(f"{n}.safetensors" for n in dtypes)
    rc, _, _ = cli(capsys, "unshard", root, tmp_path / "hf", "--format", "hf", "--keys", "dtypes",
                   "layout/big", "--strategy", "chunks", "--chunk-size", "200", "--quiet")
    assert rc == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) >= 3
    assert set(index["weight_map"]) == {f"dtypes/{n}" for n in dtypes} | {"layout/big"}
    for f in files:
        with safe_open(tmp_path / "hf" / f, "pt") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():  # noqa: SIM118 - safe_open handles iterate nothing
                assert index["weight_map"][k] == f
                want = expected["layout"]["big"] if k == "layout/big" else dtypes[k.split("/")[1]]
                assert not differences(h.get_tensor(k), want), k
    # the export reads back through ckptfs itself (hf_safetensors)
    got = ckptfs.load_keys(tmp_path / "hf")
    assert set(got) == set(index["weight_map"])
    # an existing export is refused; --overwrite replaces it and drops stale shards
    rc, _, err = cli(capsys, "unshard", root, tmp_path / "hf", "--format", "hf", "--keys", "dtypes")
    assert rc == 1 and "CheckpointExistsError" in err
    rc, _, _ = cli(capsys, "unshard", root, tmp_path / "hf", "--format", "hf", "--keys", "dtypes",
                   "--overwrite", "--quiet")
    assert rc == 0 and sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    rc, _, err = cli(capsys, "unshard", root, tmp_path / "y", "--strategy", "chunks", "--keys", "dtypes")
    assert rc == 2 and "chunk_size" in err


# ---------------------------------------------------------------------------- S3
def test_tools_on_s3(ckpts, s3, tmp_path, capsys):
    opts = ["--storage-option", f"endpoint_url={s3.endpoint}", "--storage-option", "key=testing",
            "--storage-option", "secret=testing", "--storage-option", "client_kwargs.region_name=us-east-1"]
    url = f"{s3.url}/run/step1"
    small = {"dtypes": REF["dtypes"], "mixed": REF["mixed"], "values": {"step": 3, "nan": float("nan")}}
    ckptfs.save(small, url, storage_options=s3.options)
    rc, out, err = cli(capsys, "inspect", url, "--json", *opts)
    assert rc == 0 and json.loads(out)["totals"]["tensors"] == len(flatten(small)[0]), err
    rc, out, err = cli(capsys, "verify", url, "--json", "--quiet", *opts)
    assert rc == 0 and json.loads(out)["chunks_checksummed"] == len(flatten(small)[0]), err
    rc, _, err = cli(capsys, "convert", url, f"{s3.url}/run/step1-z", "--backend", "zarr:2",
                     "--quiet", *opts)
    assert rc == 0, err
    assert_same(ckptfs.load_keys(f"{s3.url}/run/step1-z", storage_options=s3.options), small, "s3 -> s3")
    opts_file = tmp_path / "opts.json"
    opts_file.write_text(json.dumps(s3.options))
    rc, _, err = cli(capsys, "convert", url, tmp_path / "local", "--backend", "torch_dist", "--quiet",
                     "--storage-options", opts_file)
    assert rc == 0, err
    assert_same(ckptfs.load_keys(tmp_path / "local"), small, "s3 -> local")
    rc, _, err = cli(capsys, "unshard", url, tmp_path / "unsharded", "--format", "torch", "--quiet",
                     "--storage-options", opts_file)
    assert rc == 0, err
    assert_same(torch.load(tmp_path / "unsharded" / "checkpoint.pt", weights_only=True), small, "unshard")
    # a Hugging Face directory on S3: inspect, verify, convert
    hf_root, hf_expected = ckpts["hf"]
    for f in hf_root.iterdir():
        run_sync(_put(s3, f"run/hf/{f.name}", f.read_bytes()))
    rc, out, _ = cli(capsys, "verify", f"{s3.url}/run/hf", "--json", "--quiet", *opts)
    assert rc == 0 and json.loads(out)["foreign"]
    rc, _, err = cli(capsys, "convert", f"{s3.url}/run/hf", f"{s3.url}/run/hf-z", "--backend", "zarr:3",
                     "--quiet", *opts)
    assert rc == 0, err
    assert not differences(ckptfs.load_keys(f"{s3.url}/run/hf-z", storage_options=s3.options), hf_expected)


async def _put(s3, path: str, data: bytes) -> None:
    store = await open_store(s3.url, s3.options)
    try:
        await store.put(path, [data])
    finally:
        await store.close()


# ---------------------------------------------------------------------------- command line
def test_storage_options_and_sizes(tmp_path):
    import argparse

    f = tmp_path / "o.json"
    f.write_text(json.dumps({"key": "a", "client_kwargs": {"region_name": "x"}}))
    ns = argparse.Namespace(storage_options_file=str(f), storage_option=[
        "client_kwargs.region_name=us-east-1", "anon=false", "config_kwargs.retries={\"max_attempts\": 2}"])
    assert storage_options(ns) == {"key": "a", "anon": False,
                                   "client_kwargs": {"region_name": "us-east-1"},
                                   "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert [parse_size(s) for s in ("512", "5GB", "2MiB", "1.5kb")] == [512, 5 * 10**9, 2 * 2**20, 1500]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("5 parsecs")
    with pytest.raises(ckptfs.UsageError):
        storage_options(argparse.Namespace(storage_options_file=None, storage_option=["novalue"]))


@pytest.mark.slow
def test_python_m_ckptfs(ckpts, capsys):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "ckptfs", "verify", str(ckpts["hf"][0]), "--quiet"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout == "" and run.stderr == ""
    rc, _, err = cli(capsys, "unshard", "x")
    assert rc == 2 and "usage: ckptfs unshard" in err


def test_bench_dispatch(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    rc, out, _ = cli(capsys, "bench", "--list")
    assert rc == 0 and out.startswith("run ") and "zarr_quick" in out
    rc, out, _ = cli(capsys, "bench", "zarr_quick", "--help")
    assert rc == 0 and "usage:" in out and "--runs" in out
    rc, _, err = cli(capsys, "bench", "nope")
    assert rc == 2 and "suites: run" in err
    # outside a checkout, with no bench package importable: say where the benchmarks are
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT), ".")])
    rc, _, err = cli(capsys, "bench")
    assert rc == 2 and "source tree" in err
