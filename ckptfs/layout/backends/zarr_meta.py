"""zarr metadata documents of a checkpoint, produced by zarr-python (never by hand).

zarr-python creates each distinct array layout once in a MemoryStore; its ``.zarray`` /
``zarr.json`` becomes a template that gets the array's attributes and, for the ML data types
zarr-python lacks, the dtype name other implementations use (bfloat16, float8_*: created with
the unsigned integer of the same size, then renamed, as Megatron-Core/TensorStore do). The
consolidated metadata is the plain aggregation of those documents.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfs.errors import UnsupportedValueError
from ckptfs.io.optional import import_optional
from ckptfs.layout.backends.zarr_codecs import CodecOptions, ZarrFormat
from ckptfs.layout.backends.zarr_paths import join
from ckptfs.layout.dtypes import BY_NAME, ZARR_ML_NAMES

Json = Any

#: ckptfs dtype name -> numpy dtype zarr-python creates the array with
_NATIVE: dict[str, np.dtype] = {
    "bool": np.dtype("bool"), "uint8": np.dtype("uint8"), "int8": np.dtype("int8"),
    "int16": np.dtype("<i2"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
}
#: v2 ``dtype`` strings ckptfs reads (little-endian or single-byte), to ckptfs names
V2_DTYPES: dict[str, str] = {
    **{np.dtype(d).str: n for n, d in _NATIVE.items()},
    **{zname: n for n, zname in ZARR_ML_NAMES.items()},
}


def standin_dtype(name: str) -> np.dtype:
    """The numpy dtype zarr-python creates an array of ckptfs dtype ``name`` with."""
    if name in ZARR_ML_NAMES:
        return np.dtype(f"<u{BY_NAME[name].itemsize}")
    return _NATIVE[name]


@dataclass(frozen=True, slots=True)
class ArrayLayout:
    """Everything the metadata of one array depends on."""

    dtype: str  #: ckptfs dtype name
    shape: tuple[int, ...]
    chunk: tuple[int, ...]  #: chunk shape, or shard shape when ``inner`` is set
    inner: tuple[int, ...] | None = None  #: inner chunk shape (v3 sharding)


class MetadataBuilder:
    """Builds the metadata files of one checkpoint; remembers them for consolidation."""

    def __init__(self, zarr_format: ZarrFormat, codecs: CodecOptions, separator: str) -> None:
        self.zarr_format = zarr_format
        self.codecs = codecs
        self.separator = separator
        self.docs: dict[str, Json] = {}  #: store key -> JSON document, every node so far
        self._templates: dict[ArrayLayout, Json] = {}
        #: store key -> (template, attributes or None) of the array documents in ``docs``
        self._made_from: dict[str, tuple[Json, Json | None]] = {}
        self._template_text: dict[int, str] = {}  #: id(template) -> its text, attributes left open

    # -- documents --------------------------------------------------------------------------
    def add_group(self, path: str, attributes: Mapping[str, Json] | None = None) -> None:
        if self.zarr_format == 2:
            self.docs[join(path, ".zgroup")] = {"zarr_format": 2}
            if attributes:
                self.docs[join(path, ".zattrs")] = dict(attributes)
        else:
            self.docs[join(path, "zarr.json")] = {
                "attributes": dict(attributes or {}), "zarr_format": 3, "node_type": "group"}

    def add_array(self, path: str, layout: ArrayLayout, attributes: Mapping[str, Json]) -> None:
        # a shallow copy: the nested members are shared with the template, never modified
        template = self._template(layout)
        doc = dict(template)
        if self.zarr_format == 2:
            self.docs[key := join(path, ".zarray")] = doc
            self._made_from[key] = (template, None)
            self.docs[join(path, ".zattrs")] = dict(attributes)
        else:
            doc["attributes"] = dict(attributes)
            self.docs[key := join(path, "zarr.json")] = doc
            self._made_from[key] = (template, doc["attributes"])

    def files(self) -> dict[str, bytes]:
        """Every document so far, serialised as zarr-python does (indent 2). An array's
        document is its template's text (serialised once per layout) with its attributes put
        in: json's indenting encoder is pure Python, and a checkpoint of many small tensors
        has a document per tensor."""
        out = {}
        for k, v in self.docs.items():
            made = self._made_from.get(k)
            out[k] = _dumps(v) if made is None else self._spliced(*made)
        return out

    def _spliced(self, template: Json, attributes: Json | None) -> bytes:
        text = self._template_text.get(id(template))
        if text is None:
            doc = dict(template)
            if self.zarr_format == 3:
                doc["attributes"] = _HOLE  # where the template has it, or last (add_array)
            text = self._template_text[id(template)] = _dumps(doc).decode()
        if attributes is None:
            return text.encode()
        # nested lines of the attributes get the depth-1 indent; a JSON text has no raw newline
        inner = _dumps(attributes).decode().replace("\n", "\n  ")
        return text.replace(f'"{_HOLE}"', inner, 1).encode()

    def consolidated(self) -> dict[str, bytes]:
        """v2: ``.zmetadata``; v3: the root ``zarr.json`` with inline consolidated metadata
        (zarr-python's convention, not yet in the v3 spec)."""
        if self.zarr_format == 2:
            return {".zmetadata": _dumps({"zarr_consolidated_format": 1,
                                          "metadata": dict(sorted(self.docs.items()))})}
        root = dict(self.docs["zarr.json"])
        nodes = {k[: -len("/zarr.json")]: v for k, v in sorted(self.docs.items())
                 if k != "zarr.json"}
        root["consolidated_metadata"] = {"kind": "inline", "must_understand": False,
                                         "metadata": nodes}
        return {"zarr.json": _dumps(root)}

    # -- zarr-python ------------------------------------------------------------------------
    def _template(self, layout: ArrayLayout) -> Json:
        doc = self._templates.get(layout)
        if doc is None:
            doc = self._templates[layout] = self._create(layout)
        return doc

    def _create(self, layout: ArrayLayout) -> Json:
        zarr = import_optional("zarr", "the zarr backends' metadata")
        from zarr.storage import MemoryStore

        from ckptfs.layout.backends.zarr_dtypes import register

        register()  # zarr-python readers in this process see bfloat16/float8 arrays too

        if layout.dtype not in BY_NAME:
            raise UnsupportedValueError(f"zarr backend: dtype {layout.dtype!r} is unknown")
        kwargs = dict(self.codecs.zarr_python_kwargs())
        if self.zarr_format == 2:
            kwargs["chunk_key_encoding"] = {"name": "v2", "separator": self.separator}
        else:
            kwargs["chunk_key_encoding"] = {"name": "default", "separator": self.separator}
        chunks = tuple(max(1, c) for c in layout.chunk)
        if layout.inner is not None:
            kwargs["shards"] = chunks
            chunks = layout.inner
        backing: dict[str, Any] = {}
        zarr.create_array(MemoryStore(backing), shape=layout.shape,
                          dtype=standin_dtype(layout.dtype), chunks=chunks, fill_value=0,
                          zarr_format=self.zarr_format, **kwargs)
        meta = ".zarray" if self.zarr_format == 2 else "zarr.json"
        doc = json.loads(backing[meta].to_bytes())
        if layout.dtype in ZARR_ML_NAMES:
            doc["dtype" if self.zarr_format == 2 else "data_type"] = ZARR_ML_NAMES[layout.dtype]
        return doc


_HOLE = "\u2063ckptfs-attributes\u2063"  #: a string no template holds (invisible separators)


def _dumps(doc: Json) -> bytes:
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False).encode()
