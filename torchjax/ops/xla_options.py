"""The XLA compiler options of every executable torchjax compiles for eager ops: the
per-op executables (ops/cached_compute.py), fused segments (ops/fused.py) and foreach groups
(ops/foreach.py).

No excess precision: half-type results are rounded after every op, as torch does
(the half-type numerics in torchjax/ops/cached_compute.py's docstring).
"""

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
