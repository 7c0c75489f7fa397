"""The words CPU torch refuses an ``out=`` dtype with, where our check is not CPU's.

Note [out= refusals in CPU's words]
An ``out=`` call whose result cannot be written into the out's dtype is refused on CPU by
the kernel itself, and kernels word it differently: TensorIterator ops (``add``, ``exp``,
``mean``, ``std``...) say "result type Float can't be cast to the desired output type
Long"; those that keep their input's dtype (``neg``, ``round``, ``clamp``, ``gelu``)
"Found dtype Long but expected Float"; structured kernels outside TensorIterator (``mm``,
``sort``, ``tril``, ``roll``) "Expected out tensor to have dtype float, but got long int
instead"; and many their own ("index_select(): self and result must have the same scalar
type", ``cat``'s TypeError). Our check runs the op on meta tensors first (Note [out=
checks] in torchjax/ops/writeback.py), and where the meta kernel is a Python reference
(torch's ``out_wrapper``), it refuses with the reference's words ("Attempting to cast from
torch.float32 to out tensor with dtype torch.int64, but this can't be cast because it is
not safe!"), which no CPU kernel says; where no meta kernel can tell, our own cast check
says TensorIterator's words for every op.

So on that refusal path, and only there, the call is made again on CPU, with zeros
expanded to the arguments' shapes (no memory of the inputs' size) and empty outs of the
outs' dtypes, and CPU's exception (type and text) is the one raised. Kernels check the
out dtype before they read data or resize the outs, so the zeros raise what the real
values would. Where CPU runs the call (a kernel that accepts what its meta function
refuses: ``mean`` of complex into a real out writes the real part, as CPU's copy does),
the result is written with that cast; where CPU has no kernel for it, the check's own
refusal stands. CPU is asked too where the meta function accepted an out the result
cannot be cast to safely: some meta functions take what their CPU kernel refuses
(``angle`` of a float or complex tensor into an integer out).
"""

from __future__ import annotations

import warnings

import torch

from torchjax.tensor import _errors
from torchjax.tensor._tensor import JaxTensor

# The texts of torch/_prims_common/wrappers.py's ``_safe_copy_out``, said by Python meta
# kernels and never by a CPU kernel.
_REFERENCE_TEXTS = ("Attempting to cast from ", "Expected out tensor to have dtype torch.")


def is_reference_text(text: str) -> bool:
    """Whether ``text`` is a Python reference's out= dtype refusal (see the Note)."""
    return text.startswith(_REFERENCE_TEXTS)


def _to_cpu(x):
    if isinstance(x, JaxTensor):
        return torch.zeros((), dtype=x.dtype).expand(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(y) for y in x)
    return x


# ``cpu_answer``'s answer for a call CPU runs.
ACCEPTS = "accepts"


def cpu_answer(func, args, kwargs, out_names):
    """CPU's exception for ``func(*args, **kwargs)`` on zeros of the arguments' shapes
    and dtypes, with empty tensors for the ``out_names`` arguments; ``ACCEPTS`` when CPU
    runs the call; None when CPU has no kernel for it."""

    def empty(out):
        if isinstance(out, (list, tuple)):
            return [torch.zeros(o.shape, dtype=o.dtype) for o in out]
        return torch.empty(0, dtype=out.dtype)

    cargs = [_to_cpu(a) for a in args]
    ckwargs = {k: empty(v) if k in out_names else _to_cpu(v) for k, v in kwargs.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            func(*cargs, **ckwargs)
    except NotImplementedError:
        return None
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        return error
    except AssertionError:  # not a torch check: CPU's kernels raise torch's types
        return None
    return ACCEPTS


def in_cpus_words(error: Exception, func) -> Exception:
    """``error`` (CPU's) as we raise it: its type, its text, the overload appended (a
    TypeError or ValueError marked as torch's answer, not a slip of our code)."""
    return _errors.deliberate(
        type(error)(f"{error} (in aten::{func._opname}.{func._overloadname})")
    )
