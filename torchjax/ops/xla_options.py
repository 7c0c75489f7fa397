"""The XLA compiler options of every executable torchjax compiles for eager ops: the
per-op executables (ops/cached_compute.py, kernel ops of torchjax/pallas/_op.py among
them), fused segments (ops/fused.py) and foreach groups (ops/foreach_compiled.py).

No excess precision: half-type results are rounded after every op, as torch does
(the half-type numerics in torchjax/ops/cached_compute.py's docstring).
"""

import os

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


# Note [Excess precision in compiled programs]
# ``torchjax.jit`` and Dynamo programs take XLA's default, excess precision allowed: XLA may
# drop a bfloat16 rounding between two ops (a matmul's bfloat16 output converted back to
# float32 by the activation after it), so compiled results can differ from eager's in the
# last bits. Whether dropping it is also slower on TPU (the consumer then reads the
# matmul's float32 output, twice the bytes) is measured on the chip with
# ``TORCHJAX_COMPILED_EXCESS_PRECISION=0``, which builds those programs with eager's
# options instead. Read at import.
def _compiled_options() -> dict:
    raw = os.environ.get("TORCHJAX_COMPILED_EXCESS_PRECISION", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"torchjax: TORCHJAX_COMPILED_EXCESS_PRECISION={raw!r} must be '0' or '1'")
    return {} if raw == "1" else dict(COMPILER_OPTIONS)


COMPILED_PROGRAM_OPTIONS = _compiled_options()
