"""``torch.ops.torchjax.ragged_dot``: the Pallas ragged dot as a PyTorch op."""

from __future__ import annotations

from torchjax.pallas._op import op
from torchjax.pallas._ragged import ragged_dot as _ragged_dot


# x64: group sizes come as int64; the kernels trace in 32-bit mode themselves
# (Note [A kernel op's JAX mode]).
@op("torchjax::ragged_dot", x64=True)
def ragged_dot(lhs, rhs, group_sizes, transpose_rhs=False):
    """Grouped matmul on tpu tensors (``jax.lax.ragged_dot`` semantics, Pallas kernels).

    Args:
        lhs: (M, K) float tensor, rows sorted by group.
        rhs: (G, K, N), or (G, N, K) when ``transpose_rhs`` (``nn.Linear``-style expert
            weights, e.g. transformers' ``gate_up_proj``), same dtype as ``lhs``.
        group_sizes: (G,) integer tensor, rows per group, ``sum <= M``.

    Returns:
        (M, N) tensor in ``lhs``'s dtype; rows past ``sum(group_sizes)`` are 0.
        Differentiable in ``lhs`` and ``rhs`` (Pallas backward kernels).
    """
    return _ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
