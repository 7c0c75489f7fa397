"""Private PyTorch API used by torchjax, gathered in one module.

Every name here is private upstream API that may change between torch releases. Keeping
them in one place (each use covered by tests/compat/test_compat.py) means a torch
upgrade breaks exactly one module, loudly.
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table as decomposition_table
from torch._prims_common import (
    ELEMENTWISE_TYPE_PROMOTION_KIND as ELEMENTWISE_TYPE_PROMOTION_KIND,
)
from torch._prims_common import (
    REDUCTION_OUTPUT_TYPE_KIND as REDUCTION_OUTPUT_TYPE_KIND,
)
from torch._prims_common import elementwise_dtypes as elementwise_dtypes
from torch._prims_common import reduction_dtypes as reduction_dtypes
from torch.utils import backend_registration as _backend_registration


def setup_privateuse1_python_backend(name: str, backend_module, device_guard) -> None:
    """Rename PrivateUse1 to ``name`` and register a Python device guard and module.

    Wraps ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``
    (private in torch 2.13). Plain ``rename_privateuse1_backend`` is not enough: without
    a device guard ``x.to("tpu")`` fails with "PyTorch is not linked with support for
    tpu devices".
    """
    _backend_registration._setup_privateuseone_for_python_backend(
        rename=name, backend_module=backend_module, device_guard=device_guard
    )


def privateuse1_backend_name() -> str:
    return torch._C._get_privateuse1_backend_name()


def set_tensor_data(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Run the C++ ``Tensor.set_data`` (the ``.data`` setter) on ``tensor``.

    It copies sizes, strides, offset and dtype from ``new``'s TensorImpl into
    ``tensor``'s, keeping the Python object (and so autograd identity). torchjax uses it
    to change a tensor's metadata in place (``t_``, ``resize_`` of ``out=``, ``set_``).
    """
    torch._C.TensorBase.data.__set__(tensor, new)


def set_math_bits(tensor: torch.Tensor, conj: bool, neg: bool) -> None:
    """Set torch's conj and neg bits on ``tensor`` (what ``_conj``/``_neg_view`` do in
    ATen), so torch's conjugate/negative fallbacks and ``is_conj``/``is_neg`` see them."""
    torch._C._set_conj(tensor, conj)
    torch._C._set_neg(tensor, neg)


def tensor_repr(t: torch.Tensor, cpu_copy: torch.Tensor) -> str:
    """``repr(t)`` as torch prints it, with the data formatted from ``cpu_copy``.

    torch's own formatter (``torch._tensor_str``) supplies the suffixes (device, dtype,
    grad_fn, requires_grad); the data is formatted from a CPU copy so printing runs no
    tpu ops.
    """
    from torch import _tensor_str

    prefix = "tensor("
    with torch.no_grad():
        contents = _tensor_str._tensor_str(cpu_copy, len(prefix))
        text = _tensor_str._str_intern(t, tensor_contents=contents)
    # torch prefixes subclass reprs with the class name and marks parameters as
    # "Parameter(...)"; print what a CUDA tensor or parameter prints instead.
    param = text.startswith("Parameter(")
    if param:
        text = text[len("Parameter(") : -1]
    name = type(t).__name__ + "("
    if text.startswith(name):
        text = prefix + text[len(name) :]
    return "Parameter containing:\n" + text if param else text


def rebuild_device_tensor_args(cpu: torch.Tensor, dtype, device: str, requires_grad: bool):
    """A ``__reduce_ex__`` value rebuilding a device tensor from its CPU copy with
    ``torch._utils._rebuild_device_tensor_from_cpu_tensor`` (on torch.load's weights-only
    allow-list)."""
    return (
        torch._utils._rebuild_device_tensor_from_cpu_tensor,
        (cpu, dtype, device, requires_grad),
    )


def all_op_schemas():
    """Every registered operator schema (``torch._C._jit_get_all_schemas``)."""
    return torch._C._jit_get_all_schemas()


def dynamo_skip_package(name: str) -> None:
    """Tell Dynamo never to trace frames from package ``name``.

    torchjax's Python runs below Dynamo (the device guard answering
    ``torch.accelerator.current_stream`` from Dynamo's generated code,
    ``__torch_dispatch__`` on fake tensors): those frames must run as plain Python, not
    be compiled as user code. Private API (torch._dynamo.trace_rules.add).
    """
    import torch._dynamo.trace_rules as trace_rules

    trace_rules.add(name)


def dynamo_never_trace(code) -> None:
    """Dynamo runs frames of ``code``, and every frame they call, as plain Python.

    For torchjax's entry points called from C++ (``__torch_dispatch__``, the PrivateUse1
    kernels, the device guard): eager code that runs while Dynamo's callback is active
    (between graph breaks, or modules whose frames Dynamo skips) calls them on real tpu
    tensors, and jax's Python below them must never be offered to Dynamo as user code.
    Free at run time (a per-code flag). Private API (set_code_exec_strategy).
    """
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def install_to_dlpack(export) -> None:
    """Route ``torch.utils.dlpack.to_dlpack`` / ``torch.to_dlpack`` of tpu tensors to
    ``export``; other tensors go to torch's own function unchanged.

    torch's exporter is C++ and would hand out a capsule over the wrapper's empty storage
    (a null pointer) for a tpu tensor; there is no per-class hook, so the module-level
    function is wrapped. Private detail: torch.utils.dlpack.to_dlpack is
    torch._C._to_dlpack.
    """
    import torch.utils.dlpack as dlpack

    original = dlpack.to_dlpack

    def to_dlpack(tensor):
        handled = export(tensor)
        return original(tensor) if handled is None else handled

    to_dlpack.__doc__ = original.__doc__
    dlpack.to_dlpack = to_dlpack
    torch.to_dlpack = to_dlpack
