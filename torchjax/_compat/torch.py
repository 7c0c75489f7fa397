"""Private PyTorch API used by torchjax, gathered in one module.

Every name here is private upstream API that may change between torch releases. Keeping
them in one place (each use covered by tests/compat/test_compat.py) means a torch
upgrade breaks exactly one module, loudly.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections import OrderedDict

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
from torch.utils import _pytree as pytree  # noqa: F401 (torch's pytree, private)
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


def tensor_repr(t: torch.Tensor, cpu_copy: torch.Tensor, wrapper: bool = True) -> str:
    """``repr(t)`` as torch prints it, with the data formatted from ``cpu_copy``;
    ``wrapper``: ``t``'s class is the device's wrapper, printed as a plain tensor.

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
    if wrapper and text.startswith(name):
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


def untyped_storage_of(storage):
    """The UntypedStorage under ``storage`` (a TypedStorage's ``_untyped_storage``, read
    without the deprecation warning ``TypedStorage.untyped()`` gives), or ``storage``."""
    if isinstance(storage, torch.TypedStorage):
        return storage._untyped_storage
    return storage


def awaits_legacy_bytes(storage) -> bool:
    """Whether torch's legacy (non-zipfile) loader made ``storage`` and has not read its
    bytes yet: torch 2.13's ``serialization._legacy_load`` marks each storage it creates
    ``_torch_load_uninitialized`` and fills them after unpickling (the mark stays; the
    caller asks only while a load runs)."""
    return bool(getattr(storage, "_torch_load_uninitialized", False))


def rebuild_tensor_args(
    storage, offset: int, size, stride, requires_grad: bool, dtype, metadata=None
):
    """A ``__reduce_ex__`` value rebuilding a tensor over ``storage`` (an UntypedStorage)
    as ``Tensor._reduce_ex_internal`` does for a tensor with a storage: through
    ``torch._utils._rebuild_tensor_v2`` on a TypedStorage, or ``_rebuild_tensor_v3`` for
    the dtypes TypedStorage lacks (``torch.storage._new_dtypes``). Both are on torch.load's
    weights-only allow-list. ``metadata``: ``torch._utils.get_tensor_metadata``'s dict
    (the conj and neg bits), set on the rebuilt tensor as for a CPU tensor."""
    extra = (metadata,) if metadata else ()
    if dtype in torch.storage._new_dtypes():
        args = (storage, offset, size, stride, requires_grad, OrderedDict(), dtype, *extra)
        return (torch._utils._rebuild_tensor_v3, args)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    args = (typed, offset, size, stride, requires_grad, OrderedDict(), *extra)
    return (torch._utils._rebuild_tensor_v2, args)


def tensor_metadata(t: torch.Tensor) -> dict:
    """What ``torch.save`` records besides a tensor's storage and view: its conj and neg
    bits (``torch._utils.get_tensor_metadata``)."""
    return torch._utils.get_tensor_metadata(t)


def install_tensor_metadata_hook(after) -> None:
    """Have ``after(tensor)`` run each time a tensor's saved metadata (conj / neg bits)
    is set on it by torch.load's rebuild (``torch._utils.set_tensor_metadata``, which
    ``_rebuild_tensor_v2``/``v3`` look up when they run)."""
    from torchjax import _patches

    original = torch._utils.set_tensor_metadata

    @functools.wraps(original)
    def set_tensor_metadata(tensor, metadata):
        original(tensor, metadata)
        after(tensor)

    _patches.replace_attr(
        torch._utils,
        "set_tensor_metadata",
        set_tensor_metadata,
        name="torch._utils.set_tensor_metadata",
        why="a loaded conjugate or negative tpu view reads its storage through those bits",
        package="torch",
        written_for="2.13",
    )


def rebuild_parameter_args(data: torch.Tensor, requires_grad: bool, hooks, state: dict):
    """A ``__reduce_ex__`` value rebuilding ``nn.Parameter(data, requires_grad)`` with
    ``state`` (its attributes), as ``nn.Parameter.__reduce_ex__`` does: through
    ``torch._utils._rebuild_parameter`` / ``_rebuild_parameter_with_state`` (both on
    torch.load's weights-only allow-list)."""
    if not state:
        return (torch._utils._rebuild_parameter, (data, requires_grad, hooks))
    return (torch._utils._rebuild_parameter_with_state, (data, requires_grad, hooks, state))


def with_state_args(reduced, state: dict, cls=torch.Tensor):
    """``reduced`` (a ``__reduce_ex__`` value) with ``state`` (a tensor's attributes) set
    on the rebuilt tensor, as ``Tensor.__reduce_ex__`` does for a tensor with attributes
    or of a subclass ``cls``: through ``torch._tensor._rebuild_from_type_v2`` (on
    torch.load's weights-only allow-list with ``torch.Tensor``)."""
    if not state and cls is torch.Tensor:
        return reduced
    func, args = reduced
    return (torch._tensor._rebuild_from_type_v2, (func, cls, args, state))


def storage_from_pointer(data_ptr: int, device: torch.device, nbytes: int):
    """An UntypedStorage on ``device`` over ``nbytes`` at ``data_ptr``, not owning them
    (``torch._C._construct_storage_from_data_pointer``). The caller keeps the memory
    alive for the storage's lifetime."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


def all_op_schemas():
    """Every registered operator schema (``torch._C._jit_get_all_schemas``)."""
    return torch._C._jit_get_all_schemas()


def install_to_dlpack(export) -> None:
    """Route ``torch.utils.dlpack.to_dlpack`` / ``torch.to_dlpack`` of tpu tensors to
    ``export``; other tensors go to torch's own function unchanged.

    torch's exporter is C++ and would hand out a capsule over the wrapper's empty storage
    (a null pointer) for a tpu tensor; there is no per-class hook, so the module-level
    function is wrapped (Note [Process-wide changes], undone by ``torchjax.uninstall()``).
    Private detail: torch.utils.dlpack.to_dlpack is torch._C._to_dlpack.
    """
    import torch.utils.dlpack as dlpack

    from torchjax import _patches

    if _patches.is_recorded("torch.utils.dlpack.to_dlpack"):
        return
    original = dlpack.to_dlpack

    def to_dlpack(tensor):
        handled = export(tensor)
        return original(tensor) if handled is None else handled

    to_dlpack.__doc__ = original.__doc__
    why = "to_dlpack of a tpu tensor exports its jax array (torch's sees no storage)"
    for owner, name in ((dlpack, "torch.utils.dlpack.to_dlpack"), (torch, "torch.to_dlpack")):
        _patches.replace_attr(
            owner, "to_dlpack", to_dlpack, name=name, why=why, package="torch", written_for="2.13"
        )


# The in-place module moves live in torch_modules.py; re-exported here, where the rest
# of torchjax looks for private torch API.
from torchjax._compat.torch_modules import (  # noqa: E402,F401
    install_module_moves,
    install_swap_tensors,
    uninstall_swap_tensors,
)


def install_load_scope(scope) -> None:
    """Wrap ``torch.load`` (``torch.serialization.load``) so that each call runs inside
    ``scope()`` (a context manager; Note [Legacy checkpoints] in
    torchjax/device/_serialization.py), and so that torch's thread-local
    ``map_location`` (read by the rebuild of a storage-less device tensor,
    ``torch._utils._get_restore_location``) is right for this load and restored after:

    - torch sets it for the unpickling of a zipfile checkpoint only, and clears it only
      when that returns (torch 2.13, serialization._load): after one failed load every
      ``pickle.loads`` of a device tensor in the thread would be rebuilt where that load
      pointed, or refused ("Callable map_location not supported");
    - a legacy (non-zipfile) load never sets it, so such a tensor would be rebuilt on
      its saved device whatever the caller asked; it is set here for the locations that
      rebuild accepts (a string, a device or a dict).

    Same signature (``functools.wraps``), same result. Private detail: the thread-local
    is ``torch.serialization._serialization_tls``."""
    import torch.serialization as serialization

    from torchjax import _patches

    if _patches.is_recorded("torch.load"):
        return
    original = serialization.load

    @functools.wraps(original)
    def load(*args, **kwargs):
        tls = serialization._serialization_tls
        before = tls.map_location
        where = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        if isinstance(where, (str, torch.device, dict)):
            tls.map_location = where
        try:
            with scope():
                return original(*args, **kwargs)
        finally:
            tls.map_location = before

    def undo():
        if serialization.load is load:
            serialization.load = original
        if torch.load is load:
            torch.load = original

    serialization.load = torch.load = load
    _patches.record(
        "torch.load",
        why="a failed load must not leave its map_location for later pickle.loads "
        "of device tensors; a legacy load honours map_location for device tensors and "
        "fills tpu tensors once its bytes are read",
        package="torch",
        written_for="2.13",
        undo=undo,
    )


def call_composite_explicit(op, *args):
    """Run ``op``'s CompositeExplicitAutograd kernel on ``args``, skipping any kernel
    registered for the arguments' backend key (torchjax's CPU ``_pin_memory`` calls
    torch's own that way). Private API (``OpOverload._op_dk``)."""
    return op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args)


def call_composite_implicit(op, *args):
    """Run ``op``'s C++ CompositeImplicitAutograd kernel on ``args``. ``op.decompose``
    prefers a Python kernel torch registers for that key (istft's is torch/_refs', which
    drops a check the C++ kernel makes). Private API (``OpOverload._op_dk``)."""
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args)


def destroy_library(lib) -> None:
    """Remove every registration made through ``torch.library.Library`` ``lib``; kernels
    it overrode are torch's again. Private API (``Library._destroy``)."""
    lib._destroy()


def dataloader_worker_iter():
    """torch's iterator class that starts a DataLoader's worker processes (its
    ``__init__`` forks or spawns them: torch.utils.data.dataloader, private)."""
    from torch.utils.data import dataloader

    return dataloader._MultiProcessingDataLoaderIter


def seeding_all_generators() -> bool:
    """Whether the running code was called by ``torch.manual_seed``, which seeds CPU's
    default generator besides the devices (its body is ``torch.random._manual_seed_impl``
    in torch 2.13, which calls ``torch.tpu.manual_seed_all`` through
    ``_seed_custom_device``); ``torch.seed()`` and direct calls are not."""
    impl = getattr(torch.random, "_manual_seed_impl", None)
    codes = {torch.random.manual_seed.__code__}
    if impl is not None:
        codes.add(impl.__code__)
    frame = sys._getframe(1)
    for _ in range(8):  # torchjax's and torch's frames in between
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def graph_task_id() -> int:
    """The id of the autograd engine's running backward pass in this thread (-1: none)."""
    return torch._C._current_graph_task_id()


def current_autograd_node():
    """The autograd node the engine is running in this thread (None outside one)."""
    return torch._C._current_autograd_node()


def queue_engine_callback(callback) -> None:
    """Run ``callback()`` when the running backward pass ends (inside it only); an
    exception it raises is raised by ``backward()``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_keeps_graph() -> bool:
    """Whether the backward pass running in this thread keeps its graph
    (``retain_graph=True`` or ``create_graph=True``); called inside one only.
    ``torch._C._autograd._get_current_graph_task_keep_graph`` is private."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def in_graph_task() -> bool:
    """Whether this thread is running ops of a backward pass (the autograd engine's
    current graph task)."""
    return graph_task_id() != -1


def push_saved_tensors_default_hooks(pack_hook, unpack_hook) -> None:
    """What ``torch.autograd.graph.saved_tensors_hooks.__enter__`` does with its hooks."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack_hook, unpack_hook)


# Types and kernels of torch's dispatcher (torch._ops, torch._C).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
FunctionSchema = torch._C.FunctionSchema
# ``__torch_function__`` of a subclass that only overrides ``__torch_dispatch__``.
disabled_torch_function_impl = torch._C._disabled_torch_function_impl


def has_composite_implicit_kernel(func) -> bool:
    """Whether ``func`` (an OpOverload) has a CompositeImplicitAutograd kernel, which
    ``func.decompose`` runs."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


@functools.lru_cache(maxsize=None)
def _key_set(key: str):
    return torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))


def exclude_dispatch_key(key: str):
    """A context manager that skips dispatch key ``key`` (e.g. "AutocastPrivateUse1")
    for the ops called inside it (``torch._C._ExcludeDispatchKeyGuard``)."""
    return torch._C._ExcludeDispatchKeyGuard(_key_set(key))


class DeviceGuard(torch._C._acc.DeviceGuard):
    """The Python device guard of the PrivateUse1 backend (``torch._C._acc``)."""

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def create_empty_tensor(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A plain PrivateUse1 tensor of ``shape`` and ``dtype`` with no memory behind it
    (``torch._C._acc.create_empty_tensor``)."""
    return torch._C._acc.create_empty_tensor(shape, dtype)


def new_untyped_storage(cls, *args, **kwargs):
    """torch's own ``UntypedStorage.__new__`` (``torch._C.StorageBase.__new__``)."""
    return torch._C.StorageBase.__new__(cls, *args, **kwargs)


@contextlib.contextmanager
def cpp_meta_kernels():
    """Ops called inside run their C++ kernels (on meta tensors: ATen's own metadata
    rules, as in eager): torch's Python dispatcher (``torch._C._DisablePythonDispatcher``)
    and the dispatch modes of the current stack (``_disable_current_modes``) are off."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C._DisablePythonDispatcher(), _disable_current_modes():
        yield


def eager_dispatch():
    """Ops called inside dispatch as they do in eager, outside any trace: what
    ``cpp_meta_kernels`` turns off is the Python dispatcher and the dispatch modes a
    trace pushes (fake, functional, proxy)."""
    return cpp_meta_kernels()


def optimizer_scalar_dtype():
    """The dtype torch.optim gives a step counter it makes
    (``torch.optim.optimizer._get_scalar_dtype``: float32, float64 under a float64
    default dtype)."""
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype()


def has_init_group(opt) -> bool:
    """Whether ``opt`` makes its state with ``_init_group`` (torch.optim's private
    method, on every torch optimizer but LBFGS and SparseAdam; torch 2.13)."""
    return callable(getattr(opt, "_init_group", None))


def wrap_init_group(opt, after) -> None:
    """``opt._init_group`` wrapped on the instance: the class's method, then ``after(opt,
    group, fresh, lists)`` with the group's parameters that had no state before the call
    and the lists it was passed and filled (``state_steps``, which the step then reads).
    ``unwrap_init_group(opt)`` removes the wrapper."""

    def init_group(self, group, *args, **kwargs):
        fresh = [p for p in group["params"] if not self.state.get(p)]
        out = type(self)._init_group(self, group, *args, **kwargs)
        after(self, group, fresh, [a for a in (*args, *kwargs.values()) if isinstance(a, list)])
        return out

    opt._init_group = types.MethodType(init_group, opt)


def unwrap_init_group(opt) -> None:
    vars(opt).pop("_init_group", None)


def delayed_error(message: str, tensors, anchors=None):
    """``tensors`` (gradients without a graph) behind one autograd node that raises
    ``message`` when differentiated (``torch._C._functions.DelayedError``, what
    ``once_differentiable`` uses); None entries pass through. ``anchors`` (one tensor or
    None per entry: the input each gradient is of) link the node to those tensors'
    graphs, so a gradient taken with respect to them reaches the node and raises; without
    the link the node leads nowhere, and ``autograd.grad(..., allow_unused=True)`` gave
    None for a second derivative."""
    node = torch._C._functions.DelayedError(message.encode(), len(tensors))
    anchors = anchors or [None] * len(tensors)

    def marked(t, anchor):
        if t is None:
            return None
        t = t.detach()
        if anchor is not None and anchor.requires_grad:
            return t + (anchor.sum() * 0).to(t.dtype)  # a zero with an edge to anchor
        t.requires_grad = True
        return t

    out = node(*[marked(t, a) for t, a in zip(tensors, anchors)])
    return (out,) if isinstance(out, torch.Tensor) else out


def saved_tensors_hooks_enabled() -> bool:
    """Whether ``saved_tensors_hooks`` may be registered here (code under
    ``torch.autograd.graph.disable_saved_tensors_hooks`` refuses them)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def saved_tensors_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` context (a user's, ``save_on_cpu``, non-reentrant
    checkpointing) is open here. torch._C, private."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@contextlib.contextmanager
def saved_tensors_hooks_state_kept():
    """Puts torch's process-wide saved-tensor-hooks switch back as it was on exit, also
    when the body raises. A graph of ``torch.func.grad`` under Dynamo disables the hooks
    as a node of its own and enables them again in a later node: when a node between
    raises, the switch stayed off for the process (non-reentrant checkpointing then
    failed everywhere, CPU code too). torch._C, private."""
    autograd = torch._C._autograd
    message = autograd._saved_tensors_hooks_get_disabled_error_message()
    try:
        yield
    finally:
        if message is None:
            autograd._saved_tensors_hooks_enable()
        else:
            autograd._saved_tensors_hooks_disable(message)


def autograd_function_apply():
    """Dynamo's higher-order op for a user's ``autograd.Function``
    (``torch._functorch.autograd_function.autograd_function_apply``; imported on first
    use, with Dynamo's graphs)."""
    from torch._functorch.autograd_function import autograd_function_apply as op

    return op


# ``with disable_torch_function_subclass():`` runs torch functions without subclasses'
# ``__torch_function__`` (what torch.Tensor.__torch_function__ does around the call;
# torch._C, private). A tpu tensor of a user's subclass needs it (Note [User tensor
# subclasses on tpu] in torchjax/tensor/_user_subclass.py).
disable_torch_function_subclass = torch._C.DisableTorchFunctionSubclass


def infer_size(a: torch.Size, b: torch.Size) -> torch.Size:
    """The broadcast of two shapes as ATen's TensorIterator folds them, raising its own
    error (``torch._C._infer_size``, private)."""
    return torch._C._infer_size(a, b)


def autograd_view_func(t: torch.Tensor):
    """``t``'s autograd view replay, torch's own (``Tensor._view_func_unsafe``, private),
    bound to ``t``: what a subclass overriding it calls for the recorded chain."""
    return torch.Tensor._view_func_unsafe.__get__(t)


def conv_memory_format(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """The memory format CPU's convolution gives its result for these (CPU) arguments:
    the backend it would select, then that backend's format (what torch's fake tensors
    ask; ``torch._C`` private). A 1-d convolution is decided for the 2-d one CPU runs."""
    backend = torch._C._select_conv_backend(
        x, w, b, stride, padding, dilation, transposed, output_padding, groups
    )
    if w.dim() == 3:
        x, w = torch.empty(x.shape, dtype=x.dtype).unsqueeze(2), w.unsqueeze(2)
    return torch._C._conv_determine_backend_memory_format(x, w, backend)


# The base class of a Python dispatch mode (private: torch.utils._python_dispatch), used
# by the dtype-refusal survey (torchjax/testing/dtype_refusals.py) to see the ATen
# overload each CPU call reaches.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # noqa: E402
