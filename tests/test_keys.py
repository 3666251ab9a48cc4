"""Canonical keys and state-dict flattening round-trip exactly (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfs.errors import MalformedIndexError
from ckptfs.layout.keys import decode_key, encode_key
from ckptfs.layout.values import decode_value, encode_value
from ckptfs.state.flatten import flatten, unflatten

components = st.one_of(st.integers(-(10**6), 10**6), st.text(max_size=8))
paths = st.lists(components, min_size=1, max_size=5).map(tuple)


@given(paths)
def test_key_round_trip(path):
    key = encode_key(path)
    assert decode_key(key) == path
    assert all(type(a) is type(b) for a, b in zip(decode_key(key), path))


@given(st.lists(paths, min_size=2, max_size=6, unique=True))
def test_distinct_paths_have_distinct_keys(ps):
    assert len({encode_key(p) for p in ps}) == len(ps)


def test_key_examples():
    assert encode_key(("model.layers.0.weight",)) == "model.layers.0.weight"
    assert encode_key(("optim", "state", 0, "exp_avg")) == "optim/state/0/exp_avg"
    assert encode_key(("0",)) == "%30" and decode_key("%30") == ("0",)
    assert encode_key(("a/b", "50%")) == "a%2Fb/50%25"


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6),
                    st.floats(allow_nan=True, allow_infinity=True))
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), children, max_size=3),
    ),
    max_leaves=12,
)


def same(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@given(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), trees, max_size=4))
def test_flatten_unflatten_round_trip(sd):
    flat = flatten(sd)
    leaves = {k: decode_value(v, k) for k, v in flat.values.items()}
    assert same(sd, unflatten(flat.containers, leaves))


def test_value_encoding_is_json_safe():
    assert encode_value(math.inf, "k") == {"$float": "inf"}
    assert decode_value({"$float": "-inf"}, "k") == -math.inf
    with pytest.raises(MalformedIndexError, match=r"values\['k'\]"):
        decode_value({"$weird": 1}, "k")


@given(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), trees, max_size=4))
def test_flatten_keys_are_the_encoded_paths(sd):
    """flatten builds each key from its parent's (and memoises components): the same keys as
    encoding every path whole, also for the second of two equal walks (memo hits)."""
    for _ in range(2):
        flat = flatten(sd)
        assert all(encode_key(path) == key for key, path in flat.paths.items())
        assert all(encode_key(decode_key(key)) == key for key in flat.containers)
