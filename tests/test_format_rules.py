"""The rules of formats/ that a second writer or a careless reader could get wrong: the key grammar,
dict order, the JSON rules and the check order of the index, values that cannot be written, the
CRC-32C parameters, the writer rules (chunk assignment, file filling) and the ``""`` container
under torch_dist. Each case is checked against ckptfs and, where it reads, the independent
reader in tests/spec_reader.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptfs
from ckptfs.errors import FormatVersionError, MalformedIndexError, UnsupportedValueError
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.layout.keys import KEY_PATTERN, decode_key, encode_key, is_canonical
from ckptfs.planning.layouts import Description, Layout
from ckptfs.planning.save_plan import SavePlan, agree_layouts
from tests import spec_reader
from tests.test_schema import BACKENDS, SCHEMA, VALIDATOR

SPEC = (Path(__file__).resolve().parents[1] / "formats" / "README.md").read_text(encoding="utf-8")
SCHEMA_KEY = re.compile(SCHEMA["$defs"]["key"]["pattern"])  # what jsonschema runs (re.search)

# -- §3.1 keys -------------------------------------------------------------------------------------

components = st.one_of(st.integers(-(10**6), 10**6),
                       st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=6),
                       st.sampled_from(["1\n", "\u0663", "\uff11", "01", "-0", "007", "%", "/", "%2F", "-", ""]))


@given(st.lists(components, min_size=1, max_size=4).map(tuple))
def test_every_key_matches_the_grammar_in_code_schema_and_spec_reader(path):
    key = encode_key(path)
    assert is_canonical(key) and SCHEMA_KEY.search(key), key
    assert spec_reader.decode_key(key) == decode_key(key) == path
    assert [type(c) for c in spec_reader.decode_key(key)] == [type(c) for c in path]


def test_key_examples_of_the_spec():
    assert SCHEMA["$defs"]["key"]["pattern"] == KEY_PATTERN
    # whole-string, ASCII-only integers: these strings are written unescaped and stay strings
    for s in ("1\n", "\u0663", "\uff11", " 1", "+1", "1.0"):
        assert encode_key((s,)) == s and decode_key(s) == (s,) == spec_reader.decode_key(s)
    assert [encode_key((c,)) for c in ("007", "-0", "0", "-12", 7, -12)] == \
        ["%3007", "%2D0", "%30", "%2D12", "7", "-12"]
    assert encode_key(("", "")) == "/" and decode_key("/") == ("", "")


NON_CANONICAL = ["01", "-0", "%2d5", "%41", "a%2fb", "%", "%30abc", "x/007", "%25%", "%3"]


@pytest.mark.parametrize("key", NON_CANONICAL)
def test_non_canonical_keys_are_refused_by_reader_schema_and_spec_reader(key):
    d = _index(values={key: 1})
    with pytest.raises(MalformedIndexError, match=re.escape(repr(key))):
        Index.from_dict(d)
    assert not VALIDATOR.is_valid(d)
    with pytest.raises(spec_reader.SpecError):
        spec_reader.decode_key(key)


# -- §2.2 JSON and §7 check order ------------------------------------------------------------------

def _index(**over) -> dict:
    d = {"format": "ckptfs", "format_version": 1, "required_features": [],
         "backend": {"name": "safetensors_chunks", "version": 1, "options": {}},
         "containers": {}, "values": {"step": 3}, "tensors": {}, "files": {}}
    d.update(over)
    return d


def _text(**over) -> str:
    return json.dumps(_index(**over))


#: index text -> (ckptfs error, words in its message); the spec reader refuses each too
BAD_JSON = {
    "duplicate member": (_text().replace('"step": 3', '"step": 3, "step": 4'), MalformedIndexError,
                         "'step' appears twice"),
    "duplicate top-level member": ('{"format": "ckptfs", ' + _text()[1:], MalformedIndexError, "twice"),
    "overflowing float": (_text().replace('"step": 3', '"step": 1e400'), MalformedIndexError,
                          "1e400 is beyond the range"),
    "NaN literal": (_text().replace('"step": 3', '"step": NaN'), MalformedIndexError, "NaN is not JSON"),
    "lone surrogate in a value": (_text().replace('"step": 3', '"s": "a\\ud800b"'), MalformedIndexError,
                                  "lone surrogate"),
    "lone surrogate in a key": (_text().replace('"step": 3', '"\\udfff": 1'), MalformedIndexError,
                                "lone surrogate"),
    "huge int literal": (_text().replace('"step": 3', '"step": ' + "9" * 5000), MalformedIndexError,
                         "not valid JSON"),
    "format_version 1.0": (_text(format_version=1.0), MalformedIndexError, "'format_version' must be int"),
    "format_version as a string": (_text(format_version="1"), MalformedIndexError, "format_version"),
    "byte length as a string": (_text(files={"data/x": "12"}), MalformedIndexError, "files"),
    "required feature not a string": (_text(required_features=[1]), MalformedIndexError,
                                      "list of strings"),
    "null optional field": (_text(files=None), MalformedIndexError, "'files' must be dict"),
    "key in two maps": (_text(containers={"step": "dict"}), MalformedIndexError, "more than one"),
    "order lists a key twice": (_text(order=["step", "step"]), MalformedIndexError, "twice"),
    "order misses a key": (_text(order=[]), MalformedIndexError, "lacks key 'step'"),
    "order names an unknown key": (_text(order=["step", "x"]), MalformedIndexError, "'x' is not a key"),
}


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_json_rules_refused_by_reader_and_spec_reader(case):
    text, error, words = BAD_JSON[case]
    with pytest.raises(error, match=re.escape(words)):
        Index.loads(text.encode())
    with pytest.raises(spec_reader.SpecError):
        spec_reader.audit_index(text.encode())


def test_encodings_other_than_utf8_are_refused():
    text = _text()
    for data in (b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), b'{"a": "\xff"}'):
        with pytest.raises(MalformedIndexError, match="UTF-8|not valid JSON"):
            Index.loads(data)
        with pytest.raises(spec_reader.SpecError):
            spec_reader.audit_index(data)
    ok = _text(values={"emoji": "\\ud83d\\ude00", "plain": "ü"}).replace("\\\\u", "\\u")
    assert Index.loads(ok.encode()).values == {"emoji": "😀", "plain": "ü"}


def test_newer_format_version_is_the_policys_error_not_a_schema_error():
    """§7: format and format_version are checked before anything else, by readers and schema."""
    for d in (_index(format_version=2), {"format": "ckptfs", "format_version": 2}):
        assert VALIDATOR.is_valid(d)  # the schema's v1 rules apply to format_version 1 only
        with pytest.raises(FormatVersionError, match=r"format_version 2 is not supported.*\[1\]"):
            Index.from_dict(d)
    assert not VALIDATOR.is_valid({"format": "ckptfs", "format_version": 1})
    with pytest.raises(FormatVersionError, match="required feature"):
        Index.from_dict({"format": "ckptfs", "format_version": 1, "required_features": ["x"]})
    with pytest.raises(FormatVersionError, match="'format' is None"):
        Index.from_dict({"format_version": 1, "tensors": {}})


# -- §3.3 values that cannot be written, and §8: nothing committed ----------------------------------

@pytest.mark.parametrize("sd, key", [
    ({"a": {"b\ud800": 1}}, "under 'a'"), ({"s": "x\udfffy"}, "'s'"), ({"big": 10**4300}, "'big'"),
    ({"l": [1, "\ud83d"]}, "l/1"),
])
def test_unwritable_values_are_refused_at_save(tmp_path, sd, key):
    with pytest.raises(UnsupportedValueError, match=re.escape(key)):
        ckptfs.save({"w": torch.ones(2), **sd}, tmp_path / "ck")
    assert not (tmp_path / "ck" / INDEX_FILE).exists()
    ckptfs.save({"n": 10**4299, "s": "😀"}, tmp_path / "ok")  # the limit; an astral character
    assert ckptfs.load_keys(tmp_path / "ok") == {"n": 10**4299, "s": "😀"}


# -- §6 CRC-32C ------------------------------------------------------------------------------------

def test_crc32c_check_value_of_the_spec():
    stated = re.search(r"`123456789` \(the check value\) is `0x([0-9a-f]{8})`", SPEC).group(1)
    assert checksum(b"123456789") == f"crc32c:{stated}" == "crc32c:e3069283"
    assert checksum(b"") == "crc32c:00000000" == spec_reader.crc32c(b"")


# -- §3.2 order ------------------------------------------------------------------------------------

def ordered_state() -> dict:
    w = torch.arange(6.0).reshape(2, 3)
    return {
        "model": {"0.weight": w, "0.bias": w[0].clone(), "norm": w.clone()},
        "optim": {"state": {1: {"step": torch.tensor(2.0), "exp_avg": w.clone(), "exp_avg_sq": w.clone()},
                            0: {"step": torch.tensor(2.0), "exp_avg": w.clone(), "exp_avg_sq": w.clone()}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [1, 0], "eps": 1e-8}]},
        "mixed": {"b": 1, 2: "two", "a": w.clone(), -1: None, "": {"z": 1, "y": 2}, "0": 0.5},
        "epoch": 3,
    }


def keys_in_order(d, path=()) -> list:
    """Every dict's key list, depth first: what order-sensitive users see."""
    out = [(path, list(d))] if isinstance(d, dict) else []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list | tuple) else ()
    for k, v in items:
        out += keys_in_order(v, (*path, k))
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=[f"{n}-{v}" for n, v in BACKENDS])
def test_dict_order_round_trips(tmp_path, backend):
    sd = ordered_state()
    ckptfs.save(sd, tmp_path / "ck", backend=backend[0], backend_version=backend[1])
    back = ckptfs.load_keys(tmp_path / "ck")
    assert keys_in_order(back) == keys_in_order(sd)
    assert list(ckptfs.load_keys(tmp_path / "ck", ["optim/state/1"])["optim"]["state"][1]) == \
        ["step", "exp_avg", "exp_avg_sq"]
    doc = json.loads((tmp_path / "ck" / INDEX_FILE).read_bytes())
    assert doc["order"][:5] == ["model", "model/0.weight", "model/0.bias", "model/norm", "optim"]
    assert list(doc["tensors"])[:3] == ["model/0.weight", "model/0.bias", "model/norm"]
    assert list(ckptfs.load_metadata(tmp_path / "ck").tensors)[:2] == ["model/0.weight", "model/0.bias"]


def test_index_without_order_reads_the_same_tree_in_canonical_order(tmp_path):
    """An index written before ``order`` (or read by a ckptfs that ignores it) gives the same
    state dict, == included; only the iteration order is the canonical one."""
    sd = ordered_state()
    ckptfs.save(sd, tmp_path / "ck")
    path = tmp_path / "ck" / INDEX_FILE
    doc = json.loads(path.read_bytes())
    del doc["order"]
    del doc["index_checksum"]  # as an index written before both
    path.write_text(json.dumps(doc), encoding="utf-8")
    back = ckptfs.load_keys(tmp_path / "ck")
    assert list(back["model"]) == ["0.bias", "0.weight", "norm"]
    assert list(back["mixed"]) == [-1, 2, "", "0", "a", "b"]
    assert keys_in_order(back) != keys_in_order(sd)
    assert sorted(map(repr, keys_in_order(back))) != [] and _equal(back, sd)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_in_place_load_keeps_the_targets_order(tmp_path):
    ckptfs.save({"a": 1, "b": torch.ones(2)}, tmp_path / "ck")
    target = {"b": torch.zeros(2), "a": 0}
    ckptfs.load(target, tmp_path / "ck")
    assert list(target) == ["b", "a"] and target["a"] == 1


# -- writer rules ----------------------------------------------------------------------------------

def test_writer_assignment_example():
    """§2.1: replicated regions are cut into slices among their holders and each slice goes to
    the holder of the group with the fewest bytes so far (the spec's example)."""
    n = 3 << 20
    mib = 1 << 20

    def desc(rank):  # ranks 0 and 1 both hold c (3 MiB) and d (400 B): explicit replicas
        return Description((("c", Layout("uint8", (n,), box=Box((0,), (n,)), replica_id=rank)),
                            ("d", Layout("uint8", (400,), box=Box((0,), (400,)), replica_id=rank))))

    layouts = agree_layouts([desc(0), desc(1)], [0, 1], lambda d: 1)
    plan = SavePlan(layouts, 0, 2)
    got = {k: [(c.box.offsets[0], c.box.shape[0], c.writer) for c in p.chunks]
           for k, p in ((k, plan.plans[k]) for k in ("c", "d"))}
    assert got == {"c": [(0, n // 2, 0), (n // 2, n // 2, 1)], "d": [(0, 400, 0)]}, got
    assert SavePlan(layouts, 1, 2).writes() == [("c", Box((n // 2,), (n // 2,)))]
    assert n // 2 >= mib
    assert "`c` is cut into 2\n  slices of 1.5 MiB" in SPEC


def test_safetensors_files_fill_in_key_order_example(tmp_path):
    sd = {"c": torch.zeros(30, dtype=torch.uint8), "b": torch.zeros(60, dtype=torch.uint8),
          "a": torch.zeros(60, dtype=torch.uint8)}
    ckptfs.save(sd, tmp_path / "ck", backend_options={"max_file_bytes": 100})
    index = ckptfs.load_metadata(tmp_path / "ck")
    files = {k: t.chunks[0].file.rsplit("/", 1)[1] for k, t in index.tensors.items()}
    assert files == {"c": "r00000-001.safetensors", "b": "r00000-001.safetensors",
                     "a": "r00000-000.safetensors"}


# -- the "" container under torch_dist (torch_dist-1.md §Keys) ---------------------------------------

def test_empty_string_containers_under_torch_dist_match_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    cases = [{"": {}}, {"": {"v": 3}}, {"": torch.ones(2), "a": {"": torch.arange(3.0)}},
             {"": {"": {"w": torch.arange(3.0)}}, "x": 1}]
    for i, sd in enumerate(cases):
        ours, theirs = tmp_path / f"ck{i}", tmp_path / f"dcp{i}"
        ckptfs.save(sd, ours, backend="torch_dist")
        assert _equal(ckptfs.load_keys(ours), sd) and keys_in_order(ckptfs.load_keys(ours)) == keys_in_order(sd)
        if any(True for _ in _leaves(sd)):  # DCP writes nothing at all for {"": {}}
            dcp.save(sd, checkpoint_id=str(theirs), no_dist=True)
            a, b = (FileSystemReader(str(p)).read_metadata() for p in (ours, theirs))
            assert a.planner_data == b.planner_data and set(a.state_dict_metadata) == set(b.state_dict_metadata)
    target = {"": {"v": 0}}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck1"), no_dist=True)
    assert target == {"": {"v": 3}}
    with pytest.raises(UnsupportedValueError, match=r"'a\.'.*'a/'|'a/'.*'a\.'"):
        ckptfs.save({"a.": torch.ones(1), "a": {"": torch.ones(1)}}, tmp_path / "clash", backend="torch_dist")


def _leaves(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def test_empty_string_containers_on_every_backend(tmp_path):
    sd = {"": {"v": 3, "": torch.ones(2)}, "x": {"": {}}}
    for name, version in BACKENDS:
        url = tmp_path / f"{name}-{version}"
        ckptfs.save(sd, url, backend=name, backend_version=version)
        back = ckptfs.load_keys(url)
        assert _equal(back, sd), (name, version)
        assert math.isclose(back[""]["v"], 3)


def test_dcp_checkpoint_is_read_in_dcps_item_order(tmp_path):
    """A checkpoint written by DCP itself has no ckptfs index: its items are listed in the order
    DCP walked the saved state dict, and that is the order load_keys gives back."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}, "step": 3,
          "cfg": {"b": 1, "a": {"z": "x", "y": [1, 2]}}, "l": [torch.ones(1), {"k": 2, "j": 1}]}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    index = ckptfs.load_metadata(tmp_path / "dcp")
    assert index.order is not None and index.order[:3] == ("model", "model/0.weight", "model/0.bias")
    assert keys_in_order(ckptfs.load_keys(tmp_path / "dcp")) == keys_in_order(sd)
