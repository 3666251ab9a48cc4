"""PyTorch DCP storage plug-in: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through ckptfs.

    dcp.save(state_dict, storage_writer=ckptfs.dcp.StorageWriter(url))
    dcp.load(state_dict, storage_reader=ckptfs.dcp.StorageReader(url))

The writer (``writer.py``) lays DCP's write items out with a ckptfs backend and commits a ckptfs
index (JSON, crc32c, create-if-absent); ``ckptfs.load`` reads what it wrote. The reader
(``reader.py``) serves any checkpoint ckptfs reads to DCP's planner, reading only the byte ranges
of DCP's read items. ``items.py`` holds the values passed between the ranks and the key rules;
``fs_args.py`` maps DCP's ``FileSystemWriter`` / ``FileSystemReader`` arguments (or refuses
them by name) and holds DCP's ``overwrite`` semantics.
"""

from ckptfs.integrations.dcp.reader import StorageReader
from ckptfs.integrations.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
