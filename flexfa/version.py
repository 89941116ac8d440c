"""flexfa's version (read by the kernel cache key and the CLI)."""
__version__ = "0.1.0"
