"""Testing helpers: compare torchjax against CPU PyTorch on torch's OpInfo samples."""
