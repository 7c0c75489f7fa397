"""torchjax: PyTorch on JAX. ``import torchjax`` adds the device "tpu" to PyTorch.

A tensor on "tpu" is a ``torch.Tensor`` whose data is a ``jax.Array``; every ATen op on it
runs as a jax computation. See README.md.
"""

from torchjax import checkpoint as checkpoint
from torchjax import device as _device  # noqa: F401  (registers the "tpu" device)
from torchjax import ops as _ops  # noqa: F401  (fills the op table)
from torchjax import pallas as pallas  # after ops: kernels register into its table
from torchjax.compile import Jitted, RetraceWarning, export, jit
from torchjax.device._stats import reset_stats, stats
from torchjax.integrations.transformers import _loading as _hf_loading
from torchjax.interop import (
    from_jax,
    functional,
    jax_function,
    to_jax,
    tree_from_jax,
    tree_to_jax,
)
from torchjax.sharding import mesh
from torchjax.tensor import JaxTensor

# transformers' from_pretrained/save_pretrained on tpu, once transformers is imported
# (Note [Patching transformers' loading and saving]).
_hf_loading.install_when_imported()

__version__ = "0.1.0"

__all__ = [
    "JaxTensor",
    "Jitted",
    "RetraceWarning",
    "export",
    "from_jax",
    "functional",
    "jax_function",
    "jit",
    "mesh",
    "pallas",
    "reset_stats",
    "stats",
    "to_jax",
    "tree_from_jax",
    "tree_to_jax",
    "__version__",
]
