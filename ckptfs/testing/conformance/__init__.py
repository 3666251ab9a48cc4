"""The ckptfs conformance suite: every registered (backend, version) pair against the public API.

Run it with ``ckptfs conformance [--backend NAME:VERSION] [--golden-dir DIR]`` (after
``pip install 'ckptfs[conformance]'``). It uses only the public ``ckptfs`` API, so it runs
unchanged against a third-party backend registered through the ``ckptfs.backends`` entry-point
group. Golden checkpoints under ``golden/`` (package data) pin the bytes of every released
built-in (backend, version); a plugin passes its own with ``--golden-dir``. See
``make_golden.py`` and formats/PLUGINS.md.
"""
