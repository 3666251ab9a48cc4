"""The ckptfs conformance suite: every registered (backend, version) pair against the public API.

Run it with ``ckptfs conformance [--backend NAME:VERSION]`` or ``pytest conformance``. It uses
only the public ``ckptfs`` API, so it runs unchanged against a third-party backend registered
through the ``ckptfs.backends`` entry-point group. Golden checkpoints under ``golden/`` pin the
bytes of every released (backend, version): see ``make_golden.py`` and formats/PLUGINS.md.
"""
