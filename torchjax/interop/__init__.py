"""JAX and PyTorch in one program: zero-copy crossings, JAX functions called from
PyTorch with autograd, PyTorch modules as pure JAX functions."""

from torchjax.interop._convert import from_jax as from_jax
from torchjax.interop._convert import to_jax as to_jax
from torchjax.interop._convert import tree_from_jax as tree_from_jax
from torchjax.interop._convert import tree_to_jax as tree_to_jax
from torchjax.interop._debug import debug_print as debug_print
from torchjax.interop._dlpack import from_dlpack as from_dlpack
from torchjax.interop._flax import FlaxModule as FlaxModule
from torchjax.interop._flax import TorchModule as TorchModule
from torchjax.interop._functional import functional as functional
from torchjax.interop._jax_function import jax_function as jax_function
