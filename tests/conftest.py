import os

# Note [Compile speed in the suite]
# Most of the suite's time is XLA compiling many tiny programs, and on CPU most of a compile
# is code generation. The suite checks what programs compute, not how fast the code runs,
# so it compiles with two settings that cut the compile, changing only the last bits of
# some results:
# - LLVM's optimisation level 0 (a quarter less compile time). XLA emits its IR without
#   fast-math flags, so the level changes values in one way only: when optimising, LLVM
#   contracts a multiply and the add it feeds into one FMA (one rounding fewer, the last
#   bit of some results). Lowerings whose bits must match CPU's state their FMAs, or hide
#   a product from the contraction (Note [Fused Adam as CPU computes it]), so they agree
#   at every level.
# - XLA:CPU's older fusion code generator (``--xla_cpu_use_fusion_emitters=false``; a
#   third less suite time). Its transcendental functions (exp in float64, tanh, expm1,
#   log1p, cbrt, asinh) differ from the default generator's in the last bit or two, as
#   every XLA backend's do (TPU has its own): those are XLA's approximations, not
#   torchjax's lowerings, and the tests compare them with CPU within float tolerances.
#   It also multiplies complex infinities in another way (an FMA inside the product:
#   ``(huge + huge j) ** 2`` is -inf + inf j there, nan + inf j on CPU and at XLA's
#   defaults).
# Benchmarks and user code keep XLA's defaults, and tests/ops/test_complex_special_values.py
# runs its special-value grid, the most delicate of the numerics, at those defaults in a
# child process. Set either flag yourself in XLA_FLAGS to test with another value.
# On a machine with a TPU attached the suite's programs compile for the chip, and the TPU
# tier (tests/tpu) must run at XLA's defaults, as user code does: the flags are set only
# where JAX computes on the CPU (Note [The TPU tier] in tests/tpu/conftest.py).
_FAST_COMPILE = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
}


def tpu_attached() -> bool:
    """Whether JAX will compute on a TPU here: a TPU device node (``/dev/accel*``,
    ``/dev/vfio/<n>``) and no ``JAX_PLATFORMS`` naming another platform first. Read before
    JAX starts, so it looks at the machine, not at jax."""
    import glob

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not platforms.startswith("tpu"):
        return False
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


for _flag, _value in ({} if tpu_attached() else _FAST_COMPILE).items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_flag}={_value}").strip()

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


@pytest.fixture
def fresh_dynamo():
    # For files of torch.compile tests (``pytestmark = pytest.mark.usefixtures(...)``):
    # each test starts and ends with no compiled frames, guards or recompile counts.
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
