import torchjax  # noqa: F401  (registers the "tpu" device before any test collects)
