"""The ckptfs version (its own module so every layer can name it in what it writes)."""

__version__ = "0.1.0"
