"""What is saved: state-dict trees and the tensors in them."""

from ckptfs.state.flatten import FlatState, flatten, unflatten
from ckptfs.state.shards import LocalShard, ShardedTensor, local_shard

__all__ = ["FlatState", "LocalShard", "ShardedTensor", "flatten", "local_shard", "unflatten"]
