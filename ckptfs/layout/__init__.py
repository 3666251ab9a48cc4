"""How bytes are laid out: the index, dtypes, keys, backends."""
