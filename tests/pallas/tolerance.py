"""float32 tolerances of the kernel tests, by platform.

Note [Kernel float32 tolerances]
On CPU (Pallas interpret mode) a float32 kernel differs from CPU torch and from the jnp
reference only by its order of summation: 1e-5 from CPU torch, 1e-4 from the reference
on the gradients. On a TPU two more things differ from CPU: XLA:TPU's and Mosaic's
float32 ``exp``/``log`` are approximations (``log`` 7.4e-5 relative from CPU's, measured
on a v5e), and a full-precision float32 product is six bfloat16 passes. Measured on a
v5e (flash forward and gradients, causal, masked, GQA): up to 5.8e-5 from CPU torch and
1.05e-4 from the jnp reference run on the chip, the same size as XLA:TPU's own attention
(the TPU tier, tests/tpu/test_kernels.py, checks the kernel against that). So on a TPU
the tolerances are 1e-4 from CPU torch and 2e-4 from the reference; bfloat16 tolerances
(rounding of the outputs) are the same everywhere.
"""

import jax

ON_TPU = jax.default_backend() == "tpu"

#: a float32 kernel's values and gradients against CPU torch
F32_VS_CPU = dict(atol=1e-4, rtol=1e-4) if ON_TPU else dict(atol=1e-5, rtol=1e-5)
#: a float32 kernel's gradients against the jnp reference on the same device
F32_VS_REFERENCE_ATOL = 2e-4 if ON_TPU else 1e-4
