"""The engines: how a save and a load run, phase by phase, on top of the layers below. Four
rooms, one per concern; a room imports the shared modules here and rooms below it only
(tests/test_layers.py):

- ``memory/``: host memory: buffer pools and allocators, the pinned ring, device parts, the
  overflow, shared memory and its ring, parallel copies. Imports no other room.
- ``save/``: the save pipeline (``pipeline``) and its hooks, its phases (``stage``, ``write``,
  ``commit``), checked parts, the health checks, the save lock.
- ``load/``: matching targets (``targets``), the read schedule as a value (``schedule``: no
  I/O) and its run (``run``), the exchange, pre-download, GPUDirect reads, intact checks.
- ``background/``: where asynchronous saves run (``saver``), the writer process and the
  per-process default saver; above ``save/``.

Shared by the rooms: ``options`` (save and load options), ``errors`` (the error boundary),
``index_io`` (reading an index), ``small_files`` (grouping small files for one store call).
"""
