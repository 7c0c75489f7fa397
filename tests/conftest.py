import os

# The suite compiles thousands of tiny XLA programs (one per op, dtype and sample shape), and
# compiling is about half its time. LLVM's optimisation level does not change what a program
# computes (the same HLO, IEEE semantics, no fast-math at any level); level 0 compiles ~35%
# faster. Set before jax starts its backend; a user's own XLA_FLAGS are kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import torchjax  # noqa: E402, F401  (registers the "tpu" device before any test collects)
