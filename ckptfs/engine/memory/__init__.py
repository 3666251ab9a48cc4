"""Host memory: buffer pools and allocators, the pinned ring, device parts, the overflow,
shared memory and its ring, parallel copies. Imports no other room of the engine."""
