"""Layers for ``kernels.kernelize``: stateless, same ``forward`` signature as the layer
they replace, reading that layer's attributes (``weight``, ``variance_epsilon``).

They call the operators as ``torch.ops.tpu_layers.*``: Dynamo puts such a call in the
graph it hands the tpu backend, whereas calling the ``torchjax.pallas.op`` object itself
graph-breaks (Dynamo skips torchjax's frames) and runs it eagerly between two graphs.
"""

import torch
from torch import nn

from . import _ops  # noqa: F401  (defines torch.ops.tpu_layers.*)


class RMSNorm(nn.Module):
    """For Llama-style RMSNorm layers (``weight``, ``variance_epsilon``)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.ops.tpu_layers.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tpu_layers.silu_and_mul(x)
