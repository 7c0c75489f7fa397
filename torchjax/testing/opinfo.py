"""Run torch's OpInfo samples on "tpu" and on CPU and compare them.

Used by tests/ops/test_opinfo.py (the test of record) and by the coverage script; the
checks each sample runs are in torchjax/testing/checks.py.
Correctness is measured against CPU PyTorch on the same inputs: values (tolerances as
PyTorch's own ``assert_close`` uses per dtype), dtype and shape of every output, and, for
differentiable ops, the gradient of a weighted sum of the outputs w.r.t. every input.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import itertools

import torch

from torchjax._compat.torch import pytree

TPU = "tpu"

# (rtol, atol) per dtype. float32 is looser than assert_close's default because XLA and
# ATen use different (both correct) algorithms for reductions and transcendentals.
TOLERANCES = {
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.complex64,
)


# Arguments torch requires on CPU whatever the device of the input (positions in
# ``sample.args``): tensor_split's ``tensor_indices_or_sections`` is read on the host, and
# CUDA torch refuses it on the GPU just as we would.
_CPU_ARGS = {"tensor_split": (0,)}
# Ops whose samples address the input's storage directly (storage_offset, strides over
# elements outside the view): only these get the whole storage moved (other samples'
# non-contiguous inputs arrive as contiguous copies, as ``.to("tpu")`` makes them).
_WHOLE_STORAGE = frozenset({"as_strided"})


def to_tpu(obj, opinfo=None):
    """Move every CPU tensor in a pytree (or OpInfo SampleInput) to "tpu" as a fresh leaf
    (requires_grad kept). For a sample, a device argument naming "cpu" names "tpu" instead
    (factories, ``Tensor.to``), arguments in ``_CPU_ARGS`` stay on CPU, and an input that
    views part of a larger storage is moved with its whole storage, so its
    ``storage_offset`` and strides mean the same on tpu (``as_strided`` samples)."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(TPU).requires_grad_(x.requires_grad)
        return x

    moved = map_tensors(move, obj)
    if not hasattr(moved, "kwargs"):
        return moved
    kwargs = moved.kwargs
    if str(kwargs.get("device", "")) == "cpu":
        moved.kwargs = {**kwargs, "device": TPU}
    moved.args = tuple(TPU if _names_cpu(a) else a for a in moved.args)
    keep = _CPU_ARGS.get(opinfo.name, ()) if opinfo is not None else ()
    moved.args = tuple(obj.args[i].detach() if i in keep else a for i, a in enumerate(moved.args))
    if _addresses_storage(obj, opinfo):
        moved.input = _with_whole_storage(obj.input, TPU)
    return moved


def _addresses_storage(sample, opinfo) -> bool:
    """The sample's input views part of a larger storage that the op addresses."""
    x = getattr(sample, "input", None)
    return (
        opinfo is not None
        and opinfo.name in _WHOLE_STORAGE
        and isinstance(x, torch.Tensor)
        and (x.untyped_storage().nbytes() > x.numel() * x.element_size() or x.storage_offset())
    )


def _names_cpu(a) -> bool:
    return (isinstance(a, str) and a == "cpu") or (isinstance(a, torch.device) and a.type == "cpu")


def _with_whole_storage(x: torch.Tensor, device) -> torch.Tensor:
    """A copy of ``x``'s whole storage on ``device``, viewed as ``x`` views its own."""
    n = x.untyped_storage().nbytes() // x.element_size()
    whole = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (n,), (1,))
    view = whole.detach().clone().to(device).as_strided(x.shape, x.stride(), x.storage_offset())
    return view.requires_grad_(x.requires_grad) if x.requires_grad else view


def clone_cpu(obj, opinfo=None):
    """A copy of every CPU tensor in a pytree or sample (requires_grad kept); inputs of
    ``_WHOLE_STORAGE`` ops keep their whole storage, as in :func:`to_tpu`."""

    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    copied = map_tensors(copy, obj)
    if _addresses_storage(obj, opinfo):
        copied.input = _with_whole_storage(obj.input, "cpu")
    return copied


def map_tensors(fn, obj):
    # SampleInput is not a pytree node: tree_map would hand it to fn whole, unchanged,
    # and the "tpu" run would silently use the CPU tensors.
    from torch.testing._internal.opinfo.core import SampleInput

    if isinstance(obj, SampleInput):
        new = _copy.copy(obj)
        new.input, new.args, new.kwargs = pytree.tree_map(fn, (obj.input, obj.args, obj.kwargs))
        return new
    return pytree.tree_map(fn, obj)


def compare(tpu_out, cpu_out, what: str = "output", tol=None) -> None:
    """Assert ``tpu_out`` equals ``cpu_out``: same structure, dtypes, shapes, values."""
    t_leaves, _ = pytree.tree_flatten(tpu_out)
    c_leaves, _ = pytree.tree_flatten(cpu_out)
    assert len(t_leaves) == len(c_leaves), (
        f"{what}: {len(t_leaves)} leaves vs {len(c_leaves)} on CPU"
    )
    for i, (t, c) in enumerate(zip(t_leaves, c_leaves)):
        name = f"{what}[{i}]" if len(c_leaves) > 1 else what
        if isinstance(c, torch.Tensor):
            assert isinstance(t, torch.Tensor), f"{name}: got {type(t).__name__}, CPU gave a Tensor"
            assert t.device.type == TPU, f"{name}: result on {t.device}, expected tpu"
            assert t.dtype == c.dtype, f"{name}: dtype {t.dtype}, CPU gave {c.dtype}"
            assert t.shape == c.shape, f"{name}: shape {tuple(t.shape)}, CPU gave {tuple(c.shape)}"
            rtol, atol = tol or TOLERANCES.get(c.dtype, (0, 0))
            torch.testing.assert_close(
                t.detach().cpu(),
                c.detach(),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                msg=lambda m, name=name: f"{name}: {m}",
            )
        elif isinstance(c, float):
            assert t == c or (t != t and c != c) or abs(t - c) <= 1e-5 * max(1, abs(c)), (
                f"{name}: {t} vs {c}"
            )
        else:
            assert t == c, f"{name}: {t!r} vs {c!r}"


def same(fn, *args, **kwargs):
    """Run ``fn`` on CPU tensors and on their tpu copies; assert equal; return tpu result."""
    expected = fn(*args, **kwargs)
    got = fn(*to_tpu(args), **to_tpu(kwargs))
    compare(got, expected, getattr(fn, "__name__", "fn"))
    return got


def same_or_refused(call, what: str):
    """``call(device)`` on "cpu" and on "tpu": equal results (``compare``), or, where CPU
    raises, the same refusal (``assert_refuses_like``). Returns CPU's exception, if any."""
    try:
        expected = call("cpu")
    except Exception as error:  # noqa: BLE001 - tpu must refuse alike
        assert_refuses_like(error, lambda: call(TPU), what)
        return error
    compare(call(TPU), expected, what)
    return None


def grads_match(fn, *inputs, rtol=1e-7, atol=1e-7, equal_nan=False):
    """fn's value and its grads w.r.t. the floating inputs match CPU (others are passed as
    they are). A tuple result is judged by its first element (max_pool's values, not its
    indices). ``equal_nan``: NaN where CPU has NaN counts as a match."""
    diff = [t.is_floating_point() for t in inputs]
    cpu = [t.detach().clone().requires_grad_(d) for t, d in zip(inputs, diff)]
    tpu = [t.detach().to("tpu").requires_grad_(d) for t, d in zip(inputs, diff)]
    want, got = fn(*cpu), fn(*tpu)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(
        got.detach().cpu(), want.detach(), rtol=rtol, atol=atol, equal_nan=equal_nan
    )
    w = torch.rand(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
    cin = [t for t, d in zip(cpu, diff) if d]
    tin = [t for t, d in zip(tpu, diff) if d]
    gw = torch.autograd.grad((want * w).sum(), cin)
    gt = torch.autograd.grad((got * w.to("tpu")).sum(), tin)
    for a, b in zip(gt, gw):
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol, equal_nan=equal_nan)


def weights_like(out_leaves):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype)
        if o.dtype.is_complex
        else torch.rand(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) + 0.5
        for o in out_leaves
    ]


def grad_leaves(sample):
    leaves, _ = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def differentiable_outputs(out):
    leaves, _ = pytree.tree_flatten(out)
    return [
        o
        for o in leaves
        if isinstance(o, torch.Tensor)
        and o.requires_grad
        and (o.dtype.is_floating_point or o.dtype.is_complex)
    ]


def call(fn, sample):
    return fn(sample.input, *sample.args, **sample.kwargs)


def assert_refuses_like(cpu_error: Exception, run, what: str) -> None:
    """CPU torch raised ``cpu_error``: ``run()`` (the same call on tpu) must raise the same
    exception type. A missing lowering (NotImplementedError, "no lowering") is not a
    refusal: it would pass here while the op does not exist on tpu."""
    try:
        run()
    except Exception as error:  # noqa: BLE001 - judged below against CPU's exception
        missing = isinstance(error, NotImplementedError) or "no lowering" in str(error)
        if missing and not isinstance(cpu_error, NotImplementedError):
            raise AssertionError(
                f"{what}: CPU refused with {cpu_error!r}; tpu has no lowering: {error!r}"
            ) from error
        if type(error) is not type(cpu_error):
            raise AssertionError(
                f"{what}: CPU raised {type(cpu_error).__name__} ({cpu_error}), tpu raised "
                f"{type(error).__name__} ({error})"
            ) from error
        return
    raise AssertionError(f"{what}: CPU raised {cpu_error!r}, tpu did not")


def reference_entries():
    """op_db without the entries CPU torch cannot run (``torch.cuda.jiterator`` ops compile
    CUDA source at call time): with no CPU result there is nothing to compare against, so
    they are neither tested nor counted in coverage."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if not o.name.startswith("jiterator_")]


def opinfos(names):
    """The op_db entries (:func:`reference_entries`) whose ``name`` or ``name.variant`` is
    in ``names``."""
    want = set(names)
    return [
        o
        for o in reference_entries()
        if full_name(o) in want or (o.name in want and not o.variant_test_name)
    ]


# Dtypes for the in-place and out= checks: one floating and one integer dtype.
_VARIANT_DTYPES = (torch.float32, torch.int64)


def check_dtypes(opinfo, check) -> list:
    """The dtypes the suite runs ``check`` of ``opinfo`` in: forward every CPU-supported
    dtype among ``DTYPES``; backward float32 (float64 where the op has no float32) when
    the op supports autograd; in-place and ``out=`` one floating and one integer dtype."""
    supported = [d for d in DTYPES if d in opinfo.supported_dtypes("cpu")]
    if check == "forward":
        return supported
    if check == "backward":
        if not opinfo.supports_autograd:
            return []
        floats = [d for d in (torch.float32, torch.float64) if d in supported]
        return floats[:1]
    if (check == "inplace" and opinfo.get_inplace() is None) or (
        check == "out" and not opinfo.supports_out
    ):
        return []
    chosen = [d for d in _VARIANT_DTYPES if d in supported]
    return chosen or supported[:1]


def full_name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def samples(opinfo, dtype, requires_grad=False, limit=8, **kwargs):
    """The first ``limit`` CPU samples of ``opinfo`` in ``dtype`` (seeded: the same every
    call); ``kwargs`` go to ``sample_inputs`` (``num_input_tensors=`` of foreach ops)."""
    torch.manual_seed(0)
    with _no_test_case_lookup():
        it = opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad, **kwargs)
        return list(itertools.islice(it, limit))


def error_samples(opinfo) -> list:
    """``opinfo``'s CPU ``ErrorInput``s (seeded: the same every call)."""
    torch.manual_seed(0)
    with _no_test_case_lookup():
        return list(opinfo.error_inputs("cpu"))


@contextlib.contextmanager
def _no_test_case_lookup():
    """OpInfo's sample iterators look for the running ``unittest.TestCase`` by walking
    ``inspect.stack()`` (``extract_test_fn``, twice per ``sample_inputs`` call), which reads
    the source file of every frame: ~40 ms per call under pytest, a third of the OpInfo
    suite's time. Our tests are plain functions, so the walk always finds nothing; skip it
    (same samples, same seeds)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    saved = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = saved
