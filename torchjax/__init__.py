"""torchjax: PyTorch on JAX. ``import torchjax`` adds the device "tpu" to PyTorch.

A tensor on "tpu" is a ``torch.Tensor`` whose data is a ``jax.Array``; every ATen op on it
runs as a jax computation. See README.md.
"""

from torchjax import _compilation_cache, _patches
from torchjax import checkpoint as checkpoint
from torchjax import device as _device  # noqa: F401  (registers the "tpu" device)
from torchjax import ops as _ops  # noqa: F401  (fills the op table)
from torchjax import pallas as pallas  # after ops: kernels register into its table
from torchjax._budget import set_cache_budget
from torchjax._patches import UntestedVersionWarning
from torchjax.compile import DynamicShapesWarning, Jitted, RetraceWarning, bucketed, export, jit
from torchjax.device._stats import reset_stats, stats
from torchjax.integrations import _dynamo_backend, _safetensors
from torchjax.integrations.accelerate import _device as _accelerate_device
from torchjax.integrations.accelerate import _dynamo as _accelerate_dynamo
from torchjax.integrations.accelerate import _offload as _accelerate_offload
from torchjax.integrations.accelerate import _saving as _accelerate_saving
from torchjax.integrations.kernels import _backend as _kernels_backend
from torchjax.integrations.transformers import _auto_compile as _hf_auto_compile
from torchjax.integrations.transformers import _moe as _hf_moe
from torchjax.integrations.transformers import _patch_records as _hf_patches
from torchjax.integrations.transformers import _trainer as _hf_trainer
from torchjax.interop import (
    debug_print,
    from_jax,
    functional,
    jax_function,
    to_jax,
    tree_from_jax,
    tree_to_jax,
)
from torchjax.ops.fused import eager_mode, fused, set_eager_mode
from torchjax.sharding import mesh
from torchjax.tensor import JaxTensor
from torchjax.tensor._errors import DataDependentError, LeakedTracerError, TraceError

# A second process loads its executables instead of compiling them (Note [Persistent
# compilation cache]); importing compiles nothing, so every torchjax program is cached.
_compilation_cache.install()

# transformers' from_pretrained/save_pretrained on tpu, once transformers is imported
# (Note [Patching transformers' loading and saving]).
_hf_patches.install_loading_when_imported()
# accelerate's device is tpu when torch's accelerator is (Note [accelerate's device on tpu]),
# its checkpoints and disk offload take tpu tensors, and Trainer checkpoints keep the tpu
# RNG (Note [Trainer checkpoints and the tpu RNG]).
_accelerate_device.install_when_imported()
_accelerate_saving.install_when_imported()
_accelerate_offload.install_when_imported()
# torch_compile_backend="tpu" / dynamo_backend="tpu" name torchjax's backend in accelerate
# (Note [accelerate's Dynamo backend names]); safetensors' load_file takes device="tpu"
# (Note [safetensors' load_file onto tpu]).
_accelerate_dynamo.install_when_imported()
_safetensors.install_when_imported()
_hf_trainer.install_when_imported()
# generate that transformers would auto-compile on tpu runs as device programs (Note
# [transformers' auto-compile on tpu]).
_hf_auto_compile.install_when_imported()
# experts_implementation="torchjax_ragged_dot" names torchjax's ragged-dot experts
# (integrations/transformers/_moe.py), once transformers' experts registry is imported.
_hf_moe.install_when_imported()
# torch.compile(backend="tpu") finds the backend without torchjax's package metadata
# (Note [Finding the "tpu" Dynamo backend]).
_dynamo_backend.install_when_imported()
# The kernels library loads a repository's tpu build variant (Note [The Kernels Hub
# backend on tpu]).
_kernels_backend.install_when_imported()


def patches() -> list:
    """The process-wide changes in force (``torchjax._patches.Patch`` records: name, why,
    package and the release written for), oldest first. See Note [Process-wide changes]
    in torchjax/_patches.py."""
    return _patches.installed()


def uninstall() -> None:
    """Undo every process-wide change torchjax made (Note [Process-wide changes]):
    torch's and transformers' patched functions and kernels are the originals again.

    The "tpu" device itself stays registered (torch cannot unregister a backend) and tpu
    tensors keep working; what the patches added for them (``to_dlpack`` of a tpu
    tensor, the fast ``from_pretrained(device_map="tpu")``) is gone.
    """
    _patches.uninstall()


__version__ = "0.1.0"

__all__ = [
    "DataDependentError",
    "DynamicShapesWarning",
    "JaxTensor",
    "Jitted",
    "LeakedTracerError",
    "RetraceWarning",
    "TraceError",
    "UntestedVersionWarning",
    "bucketed",
    "debug_print",
    "eager_mode",
    "export",
    "fused",
    "from_jax",
    "functional",
    "jax_function",
    "jit",
    "mesh",
    "patches",
    "pallas",
    "reset_stats",
    "set_cache_budget",
    "set_eager_mode",
    "stats",
    "to_jax",
    "tree_from_jax",
    "tree_to_jax",
    "uninstall",
    "__version__",
]
