"""float32 tolerances of the kernel tests, by platform.

Note [Kernel float32 tolerances]
On CPU (Pallas interpret mode) a float32 kernel differs from CPU torch and from the jnp
reference only by its order of summation: 1e-5 from CPU torch, 1e-4 from the reference
on the gradients. On a TPU two more things differ from CPU: XLA:TPU's and Mosaic's
float32 ``exp`` (43 ulps, 5e-6 relative, from float64 at worst over [-30, 0], both the
same, measured on a v5e; glibc's is under 2 ulps) and ``log``, and a full-precision
float32 product is six bfloat16 passes. Measured on a v5e against CPU torch's float64,
as a share of each result's scale (``python -m bench.tpu --sections precision``): XLA:TPU's
own attention 9e-7 forward and 1.3e-6 on the gradients; the flash kernel 9e-7 forward but
2.7e-5 to 5.1e-5 on the gradients while its backward recomputed probabilities from a
log-sum-exp (Note [Flash residuals] says why; since changed, not yet re-measured there);
tokamax's attention gradients 6.9e-5. So on a TPU the tolerances are 1e-4 of the scale
from CPU torch and 2e-4 from the reference; bfloat16 tolerances (rounding of the
outputs) are the same everywhere.
"""

import jax

ON_TPU = jax.default_backend() == "tpu"

#: a float32 kernel's values and gradients against CPU torch
F32_VS_CPU = dict(atol=1e-4, rtol=1e-4) if ON_TPU else dict(atol=1e-5, rtol=1e-5)
#: a float32 kernel's gradients against the jnp reference on the same device
F32_VS_REFERENCE_ATOL = 2e-4 if ON_TPU else 1e-4
