"""Developer tools for torchjax (not part of the installed package)."""
