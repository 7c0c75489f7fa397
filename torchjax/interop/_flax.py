"""flax NNX modules inside PyTorch models, and PyTorch modules inside flax models.

``FlaxModule(nnx_module)`` is an ``nn.Module``: the NNX module's ``nnx.Param`` arrays
become torch Parameters on "tpu" (no copies), visible to ``model.parameters()``,
``state_dict()`` and torch optimizers, and its forward is a ``jax_function`` call, so
autograd reaches them through ``jax.vjp``. ``TorchModule(torch_module)`` is an
``nnx.Module`` whose ``nnx.Param`` entries are the torch module's parameters and buffers
(from ``torchjax.functional``), so ``nnx.grad`` / ``nnx.Optimizer`` train them.

flax is imported only when one of these is used.
"""

from __future__ import annotations

import jax
import torch

from torchjax.interop._convert import from_jax
from torchjax.interop._functional import functional
from torchjax.interop._jax_function import jax_function


def _param_name(path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "__".join(p for p in parts if p != "value")  # the Variable's own field


class FlaxModule(torch.nn.Module):
    """A flax NNX module as a PyTorch module.

    Args:
        module: an ``nnx.Module``. Its ``nnx.Param`` variables become torch Parameters
            named by their path (``layers__0__kernel``); every other variable (batch
            statistics, RNG state) stays with the module and is not trained.

    Calling it takes tpu tensors (and static Python values) and returns tpu tensors;
    gradients flow to the Parameters and to the inputs. The NNX module itself is not
    updated by torch optimizers: after training, ``to_nnx()`` returns it with the
    current parameter values.
    """

    def __init__(self, module):
        super().__init__()
        from flax import nnx

        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        leaves_with_path, self._treedef = jax.tree_util.tree_flatten_with_path(params)
        self._names = []
        for path, leaf in leaves_with_path:
            name = _param_name(path)
            self.register_parameter(name, torch.nn.Parameter(from_jax(leaf)))
            self._names.append(name)
        self._graphdef, self._rest = graphdef, rest

        def call(leaves, args, kwargs):
            merged = nnx.merge(self._graphdef, self._treedef.unflatten(leaves), self._rest)
            return merged(*args, **kwargs)

        self._call = jax_function(call)

    def forward(self, *args, **kwargs):
        leaves = [self._parameters[n] for n in self._names]
        return self._call(leaves, args, kwargs)

    def to_nnx(self):
        """The NNX module with the current (torch-trained) parameter values."""
        from flax import nnx

        from torchjax.interop._convert import array_of as to_jax

        leaves = [to_jax(self._parameters[n].detach()) for n in self._names]
        return nnx.merge(self._graphdef, self._treedef.unflatten(leaves), self._rest)


def TorchModule(module: torch.nn.Module):  # noqa: N802  (a class factory, used as one)
    """A PyTorch module (on "tpu") as a flax NNX module.

    Returns an ``nnx.Module`` whose ``params`` (an ``nnx.Dict`` of ``nnx.Param``, keyed by
    the torch parameter and buffer names, tied weights once) hold the torch module's
    arrays, and whose call runs the torch forward as a pure JAX function
    (``torchjax.functional``), so it composes with ``nnx.jit``, ``nnx.grad`` and
    ``nnx.Optimizer``. Buffers are ``nnx.BatchStat`` variables, not trained.
    """
    from flax import nnx

    class _TorchModule(nnx.Module):
        def __init__(self, module):
            params, apply = functional(module)
            trainable = {n for n, _ in module.named_parameters(remove_duplicate=False)}
            self.params = nnx.Dict(
                {
                    n: (nnx.Param(a) if n in trainable else nnx.BatchStat(a))
                    for n, a in params.items()
                }
            )
            self._apply = nnx.static(apply)

        def __call__(self, *args, **kwargs):
            values = {n: v.value for n, v in self.params.items()}
            return self._apply(values, *args, **kwargs)

    return _TorchModule(module)
