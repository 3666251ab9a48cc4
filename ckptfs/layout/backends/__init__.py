"""Built-in backends; each module implements one (name, version) of formats/."""
