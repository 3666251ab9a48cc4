"""The drop-ins: ckptfs under the frameworks' own checkpoint calls (API layer; torchtitan's sits
with the tools, which it exports through).

  dcp/              ``StorageWriter`` / ``StorageReader`` for ``torch.distributed.checkpoint``
  lightning.py      a Lightning ``CheckpointIO``
  megatron.py       Megatron-Core's save and load strategies, through ``dcp/``
  megatron_parts.py the boxes a Megatron ``ShardedTensor`` is stored as, and the container that
                    gives DCP a rank's boxes of one key
  torchtitan.py     torchtitan's checkpoint manager on ``CheckpointManager``

Their public names are ``ckptfs.dcp``, ``ckptfs.lightning``, ``ckptfs.megatron`` and
``ckptfs.torchtitan`` (ckptfs/_aliases.py), each imported on first use: this package imports
none of its modules.
"""
