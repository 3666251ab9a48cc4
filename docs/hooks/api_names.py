"""mkdocs hook: the API reference lists every name of ``ckptfs.__all__``, at build time.

``docs/api.md`` holds the marker ``<!-- api:all -->``; this hook puts a mkdocstrings block
(``::: module.name``) for each public name there, grouped, so a name added to ``__all__`` is
documented from its docstring without editing the page.
"""

from __future__ import annotations

import importlib

MARKER = "<!-- api:all -->"
GROUPS = [
    ("Saving and loading", ("save", "async_save", "load", "load_keys", "load_metadata", "delete", "close",
                            "save_model_and_optim_state", "async_save_model_and_optim_state",
                            "load_model_and_optim_state")),
    ("Tools", ("verify", "clean", "convert", "unshard", "export_hf", "load_hf_quantized", "load_hf_fp8")),
    ("Backends", ("available_backends", "get_backend", "register_backend", "register_zarr_dtypes")),
]


def _where(name: str) -> str:
    ckptfs = importlib.import_module("ckptfs")
    obj = getattr(ckptfs, name)
    module = getattr(obj, "__module__", None)
    if module is None or not hasattr(importlib.import_module(module), name):
        return f"ckptfs.{name}"
    return f"{module}.{name}"


def api_markdown() -> str:
    ckptfs = importlib.import_module("ckptfs")
    names = [n for n in ckptfs.__all__ if not n.startswith("_") and n != "INDEX_FILE"]
    placed: set[str] = set()
    out = []
    for title, group in GROUPS:
        members = [n for n in group if n in names]
        placed.update(members)
        out.append(f"## {title}\n")
        out += [f"::: {_where(n)}\n" for n in members]
    errors = [n for n in names if n not in placed and n.endswith("Error")]
    rest = [n for n in names if n not in placed and n not in errors]
    out.append("## Classes and values\n")
    out += [f"::: {_where(n)}\n" for n in sorted(rest)]
    out.append("## Errors\n")
    out += [f"::: {_where(n)}\n" for n in errors]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, api_markdown())
