import os

# Note [Compile speed in the suite]
# Most of the suite's time is XLA compiling many tiny programs, and on CPU most of a compile
# is LLVM optimising the generated code. The suite checks what programs compute, not how fast
# the code runs: XLA emits its IR without fast-math flags, so LLVM's optimisation level
# changes speed, and values in one way only: when optimising, LLVM contracts a multiply
# and the add it feeds into one FMA (one rounding fewer, the last bit of some results).
# Lowerings whose bits must match CPU's state their FMAs, or hide a product from the
# contraction (Note [Fused Adam as CPU computes it]), so they agree at every level. The
# suite compiles at level 0 (a quarter less compile time); benchmarks and user code keep
# XLA's default. Set the flag yourself in XLA_FLAGS to test at another level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# Note [The suite and the persistent compilation cache]
# ``import torchjax`` turns JAX's persistent compilation cache on in the user's cache
# directory (Note [Persistent compilation cache]); the suite must not fill it, and a test
# must compile what it checks, not load a program an earlier run wrote. So it is off here
# and in every child process the suite starts (they inherit the environment); the tests
# of the cache itself set it to a temporary directory in their child processes.
os.environ["TORCHJAX_COMPILATION_CACHE"] = "0"

import pytest  # noqa: E402

import torchjax  # noqa: F401,E402  (registers the "tpu" device before any test collects)
from torchjax.device import _checks  # noqa: E402
from torchjax.ops import fused as _fused  # noqa: E402

# Note [The suite in fused eager mode]
# ``TORCHJAX_EAGER=fused pytest ...`` runs tests with every op recorded and run in fused
# segments (Note [Fused eager] in torchjax/ops/fused.py): torchjax reads the variable at
# import. docs/performance.md lists the subset run that way and its counts.


@pytest.fixture(autouse=True)
def _no_device_check_leaks_between_tests():
    # A test that makes a failing device check without synchronising (an error-input
    # sample, a test of the op's own raise) must not fail the next test at its first
    # sync (Note [Device-side checks]). In fused mode a test's recorded ops run first,
    # so their checks are dropped with the rest.
    yield
    _fused.flush_current()
    _checks.clear_pending()
