"""Run torch's OpInfo samples on "tpu" and on CPU and compare them.

Used by tests/ops/test_opinfo.py (the test of record) and by the coverage script.
Correctness is measured against CPU PyTorch on the same inputs: values (tolerances as
PyTorch's own ``assert_close`` uses per dtype), dtype and shape of every output, and, for
differentiable ops, the gradient of a weighted sum of the outputs w.r.t. every input.
"""

from __future__ import annotations

import copy as _copy
import itertools

import torch
from torch.utils._pytree import tree_flatten, tree_map

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


def to_tpu(obj):
    """Move every CPU tensor in a pytree to "tpu" as a fresh leaf (requires_grad kept)."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(TPU).requires_grad_(x.requires_grad)
        return x

    return _map_tensors(move, obj)


def clone_cpu(obj):
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return _map_tensors(copy, obj)


def _map_tensors(fn, obj):
    # SampleInput is not a pytree node: tree_map would hand it to fn whole, unchanged,
    # and the "tpu" run would silently use the CPU tensors.
    from torch.testing._internal.opinfo.core import SampleInput

    if isinstance(obj, SampleInput):
        new = _copy.copy(obj)
        new.input, new.args, new.kwargs = tree_map(fn, (obj.input, obj.args, obj.kwargs))
        return new
    return tree_map(fn, obj)


def compare(tpu_out, cpu_out, what: str = "output", tol=None) -> None:
    """Assert ``tpu_out`` equals ``cpu_out``: same structure, dtypes, shapes, values."""
    t_leaves, _ = tree_flatten(tpu_out)
    c_leaves, _ = tree_flatten(cpu_out)
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


def _weights_like(out_leaves):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype)
        if o.dtype.is_complex
        else torch.rand(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) + 0.5
        for o in out_leaves
    ]


def _grad_leaves(sample):
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def _differentiable_outputs(out):
    leaves, _ = tree_flatten(out)
    return [
        o
        for o in leaves
        if isinstance(o, torch.Tensor)
        and o.requires_grad
        and (o.dtype.is_floating_point or o.dtype.is_complex)
    ]


def call(fn, sample):
    return fn(sample.input, *sample.args, **sample.kwargs)


def check_forward(opinfo, sample, tol=None) -> None:
    fn = opinfo.get_op()
    cpu = clone_cpu(sample)
    expected = call(fn, cpu)
    got = call(fn, to_tpu(sample))
    compare(got, expected, f"{opinfo.name} forward", tol)


def check_backward(opinfo, sample, tol=None) -> bool:
    """Compare gradients; returns False when the sample has nothing differentiable."""
    fn = opinfo.get_op()
    cpu = clone_cpu(sample)
    tpu = to_tpu(sample)
    cpu_out = _differentiable_outputs(call(fn, cpu))
    cpu_in = _grad_leaves(cpu)
    if not cpu_out or not cpu_in:
        return False
    weights = _weights_like(cpu_out)
    cpu_loss = sum(((o * w).sum() for o, w in zip(cpu_out, weights)))
    cpu_loss = cpu_loss.real if cpu_loss.is_complex() else cpu_loss
    cpu_grads = torch.autograd.grad(cpu_loss, cpu_in, allow_unused=True)
    tpu_out = _differentiable_outputs(call(fn, tpu))
    tpu_in = _grad_leaves(tpu)
    tpu_loss = sum(((o * w.to(TPU)).sum() for o, w in zip(tpu_out, weights)))
    tpu_loss = tpu_loss.real if tpu_loss.is_complex() else tpu_loss
    tpu_grads = torch.autograd.grad(tpu_loss, tpu_in, allow_unused=True)
    for i, (g, c) in enumerate(zip(tpu_grads, cpu_grads)):
        if c is None:
            assert g is None or not g.any().item(), f"grad[{i}]: CPU has none, tpu nonzero"
            continue
        assert g is not None, f"{opinfo.name} grad[{i}]: missing on tpu"
        compare(g, c, f"{opinfo.name} grad[{i}]", tol)
    return True


def check_inplace(opinfo, sample, tol=None) -> bool:
    """Run the in-place variant; returns False when it does not apply to the sample."""
    fn = opinfo.get_inplace()
    if fn is None or not isinstance(sample.input, torch.Tensor):
        return False
    cpu = clone_cpu(sample)
    cpu.input = cpu.input.detach().clone()
    try:
        expected = fn(cpu.input, *cpu.args, **cpu.kwargs)
    except RuntimeError as e:  # torch refuses (dtype cast, broadcast): tpu must refuse too
        tpu = to_tpu(sample)
        tpu.input = tpu.input.detach()
        try:
            fn(tpu.input, *tpu.args, **tpu.kwargs)
        except RuntimeError:
            return True
        raise AssertionError(f"{opinfo.name} in-place: CPU raised {e!r}, tpu did not") from None
    tpu = to_tpu(sample)
    tpu.input = tpu.input.detach()
    got = fn(tpu.input, *tpu.args, **tpu.kwargs)
    assert got is tpu.input, f"{opinfo.name} in-place: did not return self"
    compare(got, expected, f"{opinfo.name} in-place", tol)
    return True


def check_out(opinfo, sample, tol=None) -> bool:
    """Run with ``out=`` (a tpu tensor of the expected dtype); False if not applicable."""
    if not opinfo.supports_out:
        return False
    fn = opinfo.get_op()
    cpu = clone_cpu(sample)
    expected = call(fn, cpu)
    if not isinstance(expected, torch.Tensor):
        return False
    out = torch.empty(0, dtype=expected.dtype, device=TPU)
    tpu = to_tpu(sample)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fn(tpu.input, *tpu.args, **tpu.kwargs, out=out)
    assert got is out, f"{opinfo.name} out=: did not return out"
    compare(out, expected, f"{opinfo.name} out=", tol)
    return True


def opinfos(names):
    """The op_db entries whose ``name`` or ``name.variant`` is in ``names``."""
    from torch.testing._internal.common_methods_invocations import op_db

    want = set(names)
    return [
        o for o in op_db if full_name(o) in want or (o.name in want and not o.variant_test_name)
    ]


def full_name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def samples(opinfo, dtype, requires_grad=False, limit=8):
    torch.manual_seed(0)
    return list(
        itertools.islice(opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad), limit)
    )
