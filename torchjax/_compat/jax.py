"""JAX configuration torchjax relies on, gathered in one module.

Note [x64 without touching the user's JAX]
JAX disables 64-bit types by default (int64 becomes int32, float64 becomes float32).
torchjax needs them for honest dtypes, but must not flip ``jax_enable_x64`` for the
whole process: that would change the default dtypes of the user's own JAX code. So every
torchjax op runs inside ``jax.enable_x64(True)``, a thread-local context. Arrays it
produces keep their 64-bit dtypes when they leave (``torchjax.to_jax``); the user's own
``jnp`` calls outside torchjax follow the user's x64 setting, so with x64 off they narrow
64-bit inputs as JAX always does.
"""

from __future__ import annotations

import jax

x64 = jax.enable_x64
