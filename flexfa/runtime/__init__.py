"""The runtime: kernel cache (memory, disk), module loading and kernel launches."""
