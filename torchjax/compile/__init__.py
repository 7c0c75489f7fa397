"""Compiled mode: PyTorch code on tpu tensors as one jax.jit program.

``torchjax.jit`` traces a module or function (a whole train step included) with jax
tracers inside tpu tensors; ``torch.compile(backend="tpu")`` runs Dynamo's FX graphs the
same way.
"""

from torchjax.compile import (
    _captured,
    _captured_optim,
    _default_backend,
    _func_transforms,
    _grad_scaler,
    _remat,
)
from torchjax.compile._buckets import bucketed as bucketed
from torchjax.compile._export import export as export
from torchjax.compile._jit import DynamicShapesWarning as DynamicShapesWarning
from torchjax.compile._jit import Jitted as Jitted
from torchjax.compile._jit import RetraceWarning as RetraceWarning
from torchjax.compile._jit import jit as jit

# torch.compile's default backend sends tpu graphs to the "tpu" backend (Note [The
# default torch.compile backend on tpu] in _default_backend.py).
_default_backend.install()
# A checkpointed region is recomputed in a compiled program, not merged with its forward
# (Note [Checkpointed regions in compiled programs] in _remat.py).
_remat.install()
# torch.func's grad, vjp and jacrev run inside a compiled function (Note [torch.func
# transforms in compiled programs] in _func_transforms.py).
_func_transforms.install()
# A GradScaler step skips the optimizer on the device when traced (Note [GradScaler
# steps in compiled programs] in _grad_scaler.py).
_grad_scaler.install()
# In fused eager mode a repeated tpu module call runs as one program (Note [Captured
# module calls] in _captured.py): nn.Module.__call__ is patched while the mode may be on.
_captured.install()
# ... and a repeated optimizer step as one program (Note [Captured optimizer steps] in
# _captured_optim.py): torch.optim's global step hooks are registered while it may be on.
_captured_optim.install()


def dynamo_stats() -> dict:
    """Counters of the ``torch.compile(backend="tpu")`` backend; see
    torchjax/compile/_dynamo.py ``stats``. Imports Dynamo's side only when asked."""
    from torchjax.compile._dynamo import stats

    return stats()
