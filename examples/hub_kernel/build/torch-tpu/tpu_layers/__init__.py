"""tpu-layers: a Kernels Hub repository's ``torch-tpu`` build variant, for torchjax.

Every function is a JAX function (here Pallas kernels) registered as a torch operator
with ``torchjax.pallas.op``, so it runs on "tpu" tensors in eager, under
``torchjax.jit`` and under ``torch.compile(backend="tpu")``, with autograd.

- ``rms_norm``, ``silu_and_mul``: Pallas kernels (``_ops.py``);
- ``experts``: a MoE experts forward on torchjax's Pallas ragged dot, and
  ``experts_forward``, its transformers ``ExpertsInterface`` form;
- ``layers``: ``RMSNorm`` and ``SiluAndMul``, stateless layers for ``kernelize``.
"""

from . import layers
from ._ops import CALLS, experts, experts_forward, rms_norm, silu_and_mul

__all__ = ["CALLS", "experts", "experts_forward", "layers", "rms_norm", "silu_and_mul"]
