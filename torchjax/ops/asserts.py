"""Device-side assertions: ``torch._assert_async`` and the ops torch builds on it.

``torch._assert_async(cond, msg)`` is CUDA's asynchronous assert: the condition stays on
the device and a failure surfaces later. On tpu it is a device check (Note [Device-side
checks] in torchjax/device/_checks.py): nothing is read at the op, and the next
synchronisation point raises ``RuntimeError(msg)``, or the op itself in immediate mode.

``F.one_hot`` uses it. For a tensor with the Python dispatch key (every tpu tensor)
ATen's CompositeImplicitAutograd kernel takes its "functional" path, ``eq(x[..., None],
arange(n))``, which checks nothing: an index past ``num_classes`` or below 0 gave a row
of zeros, a silent wrong result. A fallthrough at ``AutogradPrivateUse1`` sends
``aten::one_hot`` to the registry instead, whose decomposition is ATen's device path:
the same ``eq`` after two ``_assert_async`` checks. (CPU reads min and max back and
raises "Class values must be non-negative." / "... smaller than num_classes."; the
device path's texts are those with a "one_hot: " prefix, as on CUDA.)
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchjax.device import _checks
from torchjax.ops.registry import handler, lowering

aten = torch.ops.aten


@lowering(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(self, assert_msg=None):
    """aten::_assert_async - raise ``RuntimeError(assert_msg)`` (at the next sync) when the
    one-element ``self`` is zero/False."""
    if self.size != 1:
        kind = "no values" if self.size == 0 else "more than one value"
        raise RuntimeError(f"Boolean value of Tensor with {kind} is ambiguous")
    if assert_msg is None:
        assert_msg = "Expected Tensor with single nonzero value, but got zero"
    # The message is a template for the check's value: braces in it are literal. It is
    # raised at a later op (the sync point): it names this one.
    template = assert_msg.replace("{", "{{").replace("}", "}}") + " (in aten::_assert_async)"
    _checks.require(jnp.reshape(self, ()) == 0, 0, RuntimeError, template)


@handler(aten.one_hot.default)
def one_hot(args, kwargs):
    """aten::one_hot - ATen's device path (module docstring), after CPU's dtype check,
    which that path reached through the registry does not make."""
    if args[0].dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    return aten.one_hot.default.decompose(*args, **kwargs)


# Autograd above one_hot has nothing to do (its result is int64): fall through to the
# registry (module docstring).
_ONE_HOT_LIB = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
_ONE_HOT_LIB.impl("one_hot", torch.library.fallthrough_kernel)
