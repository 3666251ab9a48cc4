"""The engines: how a save and a load run, phase by phase, on top of the layers below.

- ``read``: the read engine (read pieces -> byte reads -> placement in the targets).
- ``index_io``: reading an index (or sniffing a foreign checkpoint) from a store.
- ``pre_download``: copying a node's files into a local work_dir before a load.
- ``stage``, ``write``, ``commit``: the three phases of a save; ``buffers``: the allocator.
- ``background``: where asynchronous saves run (one in flight, reusable staging buffers).
"""
