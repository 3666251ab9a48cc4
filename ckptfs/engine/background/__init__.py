"""Background savers: the in-process saver thread, the writer process, and the per-process
default saver."""
