"""The value checks of the loss ops: what torch refuses after reading the data (a
probability outside [0, 1], a class target out of range, CTC lengths that do not fit).

Each is made where torch makes it (Note [Device-side checks] in
torchjax/device/_checks.py): deferred where CUDA's kernel makes it a device assert
(``binary_cross_entropy``'s input and target, Loss.cu; ``multi_margin_loss``'s target,
LossMultiMargin.cu), raised at the next synchronisation point with CPU's text and the op
named; at the op where CPU reads the values on the host and CUDA checks nothing
(``multilabel_margin_loss``'s target, LossMultiLabelMargin.cpp) or both read them there
(CTC's lengths, LossCTC.cpp and LossCTC.cu), with CPU's exception and text word for
word. CTC lengths given as Python lists (or CPU tensors, which ``ctc_loss`` turns into
lists: Note [ctc_loss with CPU lengths] in loss.py) are checked on the host; tpu length
tensors on the device, read at the op. Under ``torchjax.jit`` and ``torch.compile`` the
device checks are outputs of the program (Note [Device checks of compiled programs]);
list lengths are constants of the trace, so the trace raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.device import _checks
from torchjax.ops.indexing import require_in_range
from torchjax.ops.registry import precheck
from torchjax.ops.schema import arg
from torchjax.tensor import _errors
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------
# binary_cross_entropy


@jax.jit
def _bce_first_bad(x, t):
    # (any element of input or target outside [0, 1] or NaN, 0 if the first such
    # element's input is bad, else 1): CPU's kernel checks input, then target, element by
    # element, so the first bad element decides the message.
    x, t = jnp.broadcast_arrays(x, t)
    bad_in = ~((x >= 0) & (x <= 1)).reshape(-1)
    bad = bad_in | ~((t >= 0) & (t <= 1)).reshape(-1)
    return jnp.any(bad), jnp.where(bad_in[jnp.argmax(bad)], 0, 1)


def _bce_text(which, _) -> str:
    name = "input" if which == 0 else "target"
    return f"all elements of {name} should be between 0 and 1 (in aten::binary_cross_entropy)"


@precheck(aten.binary_cross_entropy)
def _bce_range(args, kwargs) -> None:
    """CPU raises ``all elements of input (target) should be between 0 and 1``; CUDA
    asserts both in its kernel (Loss.cu): a deferred device check. Float tensors only:
    other dtypes are refused as CPU refuses them (ops/dtype_refusals.py)."""
    x, t = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "target")
    if not (isinstance(x, JaxTensor) and isinstance(t, JaxTensor)):
        return
    if not (x.dtype.is_floating_point and t.dtype.is_floating_point) or not x.numel():
        return
    try:
        torch.broadcast_shapes(x.shape, t.shape)
    except RuntimeError:
        return  # the op refuses the shapes itself
    bad, which = _bce_first_bad(x._value(), t._value())
    _checks.require(bad, which, RuntimeError, _bce_text)


# ---------------------------------------------------------------------------------------
# multi_margin_loss, multilabel_margin_loss


def check_multi_margin_target(target, classes: int) -> None:
    """CPU's ``target out of range`` (LossMultiMargin.cpp); CUDA asserts it in its kernel:
    deferred."""
    require_in_range(
        target, 0, classes, RuntimeError, "target out of range (in aten::multi_margin_loss)"
    )


def check_multilabel_target(self, target) -> None:
    """CPU reads ``target.min() >= -1`` and ``target.max() < dim`` back at the op
    (LossMultiLabelMargin.cpp); CUDA checks nothing: a check at the op, CPU's text."""
    if self.size == 0:
        return
    dim = self.shape[-1] if self.ndim else 1
    text = "argument #2 'target' is out of range"
    require_in_range(target, -1, dim, RuntimeError, text, deferred=False)


# ---------------------------------------------------------------------------------------
# CTC: ctc_loss_allocate_outputs' checks (LossCTC.cpp), in its order

_WHERE = " (while checking arguments for ctc_loss_allocate_outputs)"
_TARGETS = " for argument #2 'targets'" + _WHERE
_TARGET_LENGTH_TEXT = (
    "Expected target_lengths to have value at least 0, but got value {value}" + _WHERE
)
_SIZE_TEXT = "Expected tensor to have size {value} at dimension 0, but got size {value2}" + _TARGETS
_PADDED_TEXT = (
    "Expected tensor to have size at least {value} at dimension 1, but got size {value2}" + _TARGETS
)


def _input_length_text(length, t) -> str:
    if length < 0:
        return f"Expected input_lengths to have value at least 0, but got value {length}" + _WHERE
    return f"Expected input_lengths to have value at most {t}, but got value {length}" + _WHERE


def _first(bad, values):
    """(any of ``bad``, the value at the first True)."""
    return bad.any(), values[bad.argmax()]


def _at_op(bad, value, template) -> None:
    """A check CPU and CUDA make on the host: raised now where the values are host values
    (lengths given as lists, sizes), else a device check read at the op."""
    if not isinstance(bad, (bool, np.bool_)):
        _checks.require(bad, value, RuntimeError, template, deferred=False)
        return
    if bad:
        first, second = (int(v) for v in (value if isinstance(value, tuple) else (value, 0)))
        if callable(template):
            text = template(first, second)
        else:
            text = template.format(value=first, value2=second)
        raise _errors.verbatim(RuntimeError(text))


def _size(lengths) -> int:
    return len(lengths) if isinstance(lengths, (list, tuple)) else lengths.size


def _lengths(lengths):
    # Values the lowering has (a list; an array run op by op or a constant of a trace,
    # which the lowering reads for its sizes anyway) as int64 NumPy, checked on the host;
    # a tracer (inside the op's executable, or a traced input) as it is, on the device.
    if isinstance(lengths, jax.core.Tracer):
        return lengths.reshape(-1)
    return np.asarray(lengths, dtype=np.int64).reshape(-1)


def check_ctc_lengths(log_probs, targets, input_lengths, target_lengths, blank) -> None:
    """LossCTC.cpp's ``ctc_loss_allocate_outputs`` checks, which CPU and CUDA make on the
    host, in its order: lengths as lists are read here, int arrays on the device at the
    op. ``log_probs`` is 3-D and ``targets`` 1-D or 2-D (checked before)."""
    t_max, batch, labels = log_probs.shape
    if not 0 <= blank < labels:
        raise _errors.verbatim(RuntimeError("blank must be in label range"))
    if _size(input_lengths) != batch:
        raise _errors.verbatim(RuntimeError("input_lengths must be of size batch_size"))
    if _size(target_lengths) != batch:
        raise _errors.verbatim(RuntimeError("target_lengths must be of size batch_size"))
    if batch == 0:
        return
    tl, il = _lengths(target_lengths), _lengths(input_lengths)
    _at_op(*_first(tl < 0, tl), _TARGET_LENGTH_TEXT)
    if targets.ndim == 1:
        total = tl.sum()
        _at_op(total != targets.shape[0], (total, targets.shape[0]), _SIZE_TEXT)
    else:
        _at_op(targets.shape[0] != batch, (batch, targets.shape[0]), _SIZE_TEXT)
        longest = tl.max()
        _at_op(longest > targets.shape[1], (longest, targets.shape[1]), _PADDED_TEXT)
    bad, length = _first((il < 0) | (il > t_max), il)
    _at_op(bad, (length, t_max), _input_length_text)
