"""tpu parameters take torch.optim's foreach implementation by default, as CUDA's do.

Note [tpu parameters take torch.optim's foreach path]
An optimizer built with ``foreach=None`` (the default) asks torch 2.13's
``_default_to_fused_or_foreach`` which implementation to run: the foreach one
(``_multi_tensor_adam``: about a dozen ``_foreach_*`` ops per step for a whole parameter
group) when every parameter's device is in ``_get_foreach_kernels_supported_devices()``,
which lists the PrivateUse1 backend, so "tpu", and its exact ``type(p)`` is in
``torch.optim.optimizer._foreach_supported_types`` (``Tensor``, ``Parameter``). A tpu
parameter is a ``JaxTensor``, so tpu optimizers took the single-tensor loop: about a
dozen ops per parameter per step, each dispatched (or recorded, in fused eager) on its
own, a large share of a train step's host time. ``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_`` and ``get_total_norm`` decide the same way from
``torch.utils._foreach_utils._foreach_supported_types`` (``Tensor``).

``JaxTensor`` joins both lists (``install_foreach_type`` in torchjax/_compat/torch_optim.py),
as torch's own ``DTensor`` does. A ``_foreach_*`` op on tpu lists is one executable (Note
[Compiled foreach] in torchjax/ops/foreach_compiled.py), or one recorded node in fused eager. The
numbers are CPU's default (single-tensor) ones for every optimizer whose foreach and
single-tensor paths agree on CPU; where they differ on CPU too, tpu gives CPU's
``foreach=True`` numbers, as CUDA does (tests/device/test_optim_foreach.py). Explicit
choices keep their meaning: ``foreach=False`` and ``differentiable=True`` take the
single-tensor loop, and Adam with a tensor ``lr`` too (torch's rule); ``fused=True`` stays
opt-in, its numbers those of CPU's fused kernel, not of CPU's default. Only the type
``JaxTensor`` is added: CPU tensors (and every other type) take the path they took.
"""

from __future__ import annotations

from torchjax._compat.torch_optim import install_foreach_type
from torchjax.tensor._tensor import JaxTensor


def register() -> None:
    """Add ``JaxTensor`` to torch's foreach type lists (Note [tpu parameters take
    torch.optim's foreach path]); idempotent."""
    install_foreach_type(
        JaxTensor,
        why="torch.optim's optimizers and clip_grad_norm_ take their foreach path for tpu "
        "tensors by default, as for CUDA's, instead of the per-parameter loop",
    )
