"""The load: targets matched to the index, the read schedule (a value, no I/O) and its run,
the exchange between ranks, pre-download and GPUDirect reads."""
