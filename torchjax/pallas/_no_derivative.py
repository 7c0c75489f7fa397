"""A kernel op whose JAX function JAX cannot differentiate (torchjax/pallas/_op.py)."""

from __future__ import annotations


# Note [A kernel op without a derivative]
# JAX differentiates a function through its primitives' derivative rules; a
# ``pallas_call`` has none (jax cannot see through the kernel), so ``jax.vjp`` of a
# function calling a kernel fails ("Linearization failed ...") unless the function is a
# ``jax.custom_vjp``. torch runs the forward of a ``torch.library`` custom op without an
# autograd formula and raises at ``backward()`` (RuntimeError "Trying to backward
# through mylib.f.default but no autograd formula was registered"). A kernel op does the
# same: an eager call that would keep the pullback runs the plain forward instead (once
# per signature: the failure is remembered), its outputs require grad, and the backward
# op raises that RuntimeError naming the op and the fix, a ``jax.custom_vjp``
# (docs/kernels.md). Under ``torchjax.jit`` the backward op is traced where
# ``backward()`` is called and raises there.
def no_derivative(error: BaseException) -> bool:
    """Whether ``error`` is JAX failing to differentiate a function (an operation
    without a derivative rule, such as a ``pallas_call``)."""
    text = str(error)
    return "Linearization failed" in text or "Differentiation rule for" in text


def no_derivative_error(qualname: str) -> RuntimeError:
    """torch's error for a custom op without an autograd formula, naming the fix."""
    ns, _, name = qualname.partition("::")
    return RuntimeError(
        f"Trying to backward through {ns}.{name}.default but JAX cannot differentiate its "
        "function (a pallas_call, or another operation without a derivative rule). Give "
        "the function a jax.custom_vjp with the backward (see docs/kernels.md), or call "
        "the op on tensors that do not require grad."
    )
