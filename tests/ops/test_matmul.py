"""Tests for torchjax/ops/matmul.py: OpInfo sweep plus what OpInfo misses."""

import re

import jax
import jax.numpy as jnp
import pytest
import torch
import torch._dynamo

import torchjax
from tests.ops.opinfo_cases import make_tests
from torchjax.ops import matmul as matmul_ops
from torchjax.testing import opinfo as oi

OPS = [
    "mm",
    "bmm",
    "addmm",
    "addmm.decomposed",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "baddbmm",
    "addbmm",
    "matmul",
    "nn.functional.linear",
    "einsum",
    "outer",
    "inner",
    "tensordot",
    "linalg.vecdot",
    "nn.functional.bilinear",
]
globals().update(make_tests(OPS))


def _close(got, want, **kw):
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), want, **kw)


@pytest.mark.parametrize(
    "shapes",
    [
        ((3,), (3,)),
        ((3,), (3, 4)),
        ((2, 3), (3,)),
        ((5, 2, 3), (3, 4)),
        ((3,), (5, 3, 4)),
        ((2, 1, 2, 3), (5, 3, 4)),
        ((5, 2, 3), (5, 3, 4)),
    ],
)
def test_matmul_broadcasting(shapes):
    a, b = (torch.randn(s, dtype=torch.float64) for s in shapes)
    _close(torch.matmul(a.to("tpu"), b.to("tpu")), torch.matmul(a, b))


def test_addmm_beta_zero_ignores_nan():
    m = torch.full((2, 2), float("nan"))
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    want = torch.addmm(m, a, b, beta=0, alpha=2)
    _close(torch.addmm(m.to("tpu"), a.to("tpu"), b.to("tpu"), beta=0, alpha=2), want)


def test_mm_int64_large_values():
    a = torch.tensor([[2**40, 1], [3, 2**33]], dtype=torch.int64)
    b = torch.tensor([[3, 0], [1, 5]], dtype=torch.int64)
    _close(a.to("tpu") @ b.to("tpu"), a @ b)


def test_mm_bf16_accumulates_in_float32():
    a = torch.randn(4, 512).bfloat16()
    b = torch.randn(512, 3).bfloat16()
    _close(a.to("tpu") @ b.to("tpu"), a @ b, rtol=1.6e-2, atol=1e-2)


def test_empty_and_out():
    a, b = torch.randn(0, 3), torch.randn(3, 4)
    _close(a.to("tpu") @ b.to("tpu"), a @ b)
    z = torch.mm(torch.randn(2, 0).to("tpu"), torch.randn(0, 3).to("tpu"))
    _close(z, torch.zeros(2, 3))
    out = torch.empty(2, 4, device="tpu")
    x, y = torch.randn(2, 3), torch.randn(3, 4)
    r = torch.mm(x.to("tpu"), y.to("tpu"), out=out)
    assert r is out
    _close(out, x @ y)


def test_mm_shape_error():
    # CPU's text, then the op's name.
    text = r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\) \(in aten::mm"
    with pytest.raises(RuntimeError, match=text):
        torch.mm(torch.randn(2, 3).to("tpu"), torch.randn(4, 5).to("tpu"))


def test_mm_dtype_error():
    with pytest.raises(RuntimeError, match="aten::mm"):
        torch.mm(torch.randn(2, 3).to("tpu"), torch.randn(3, 5, dtype=torch.float64).to("tpu"))


def test_linear_backward_batched():
    x = torch.randn(2, 5, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    tx, tw, tb = (t.detach().to("tpu").requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x, w, b).pow(2).sum().backward()
    torch.nn.functional.linear(tx, tw, tb).pow(2).sum().backward()
    for t, c in ((tx, x), (tw, w), (tb, b)):
        _close(t.grad, c.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_grouped_mm(case):
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([2, 5, 8], dtype=torch.int32)
    if case == "2d3d":
        a, b = torch.randn(8, 4, generator=g), torch.randn(3, 4, 6, generator=g)
        want = torch.cat([a[0:2] @ b[0], a[2:5] @ b[1], a[5:8] @ b[2]])
    elif case == "3d3d":
        offs = None
        a, b = torch.randn(3, 2, 4, generator=g), torch.randn(3, 4, 6, generator=g)
        want = a @ b
    elif case == "2d2d":
        a, b = torch.randn(5, 8, generator=g), torch.randn(8, 6, generator=g)
        want = torch.stack([a[:, 0:2] @ b[0:2], a[:, 2:5] @ b[2:5], a[:, 5:8] @ b[5:8]])
    else:
        a, b = torch.randn(3, 5, 4, generator=g), torch.randn(4, 8, generator=g)
        want = torch.cat([a[0] @ b[:, 0:2], a[1] @ b[:, 2:5], a[2] @ b[:, 5:8]], dim=1)
    got = torch.ops.aten._grouped_mm(
        a.to("tpu"), b.to("tpu"), None if offs is None else offs.to("tpu")
    )
    _close(got, want, rtol=1e-5, atol=1e-5)


_NAN_INF = torch.tensor([[float("nan"), 1.0], [1.0, float("inf")]])
_SELF = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
_ADD_FORMS = {
    "addmm": lambda s, a, b, **k: torch.addmm(s, a, b, **k),
    "addmv": lambda s, a, b, **k: torch.addmv(s[0], a, b[0], **k),
    "addbmm": lambda s, a, b, **k: torch.addbmm(s, a.expand(3, 2, 2), b.expand(3, 2, 2), **k),
    "baddbmm": lambda s, a, b, **k: torch.baddbmm(s[None], a[None], b[None], **k),
    "addr": lambda s, a, b, **k: torch.addr(s, a[0], b[0], **k),
}


# Complex only with alpha == 0: a complex product with inf differs from CPU's in where
# NaN appears (a known difference, docs/numerics.md).
_SCALES = [
    (beta, alpha, dtype)
    for beta, alpha in [(1, 0), (0, 0), (0.5, 0.0), (0, 1), (1, 1)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.complex64)
    if not (dtype.is_complex and alpha != 0)
]


@pytest.mark.parametrize("name", sorted(_ADD_FORMS))
@pytest.mark.parametrize("beta, alpha, dtype", _SCALES)
def test_add_forms_with_a_zero_scale_as_cpu(name, beta, alpha, dtype):
    # CPU's BLAS gemm/gemv (addmm, addbmm; addmv in real types) skip the product when
    # alpha is 0, so NaN/inf in the matrices stay out; baddbmm, addr and the half types
    # multiply and propagate them. beta == 0 ignores self everywhere.
    fn = _ADD_FORMS[name]
    s, a, b = _SELF.to(dtype), _NAN_INF.to(dtype), torch.ones(2, 2, dtype=dtype)
    want = fn(s, a, b, beta=beta, alpha=alpha)
    got = fn(s.to("tpu"), a.to("tpu"), b.to("tpu"), beta=beta, alpha=alpha).cpu()
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


_BOOL = torch.ones(2, 2, dtype=torch.bool)
_BOOL_PRODUCTS = {
    "mm": lambda d: torch.mm(_BOOL.to(d), _BOOL.to(d)),
    "bmm": lambda d: torch.bmm(_BOOL[None].to(d), _BOOL[None].to(d)),
    "mv": lambda d: torch.mv(_BOOL.to(d), _BOOL[0].to(d)),
    "dot": lambda d: torch.dot(_BOOL[0].to(d), _BOOL[0].to(d)),
    "matmul": lambda d: _BOOL.to(d) @ _BOOL.to(d),
    "addmm": lambda d: torch.addmm(_BOOL.to(d), _BOOL.to(d), _BOOL.to(d)),
    "baddbmm": lambda d: torch.baddbmm(_BOOL[None].to(d), _BOOL[None].to(d), _BOOL[None].to(d)),
}


@pytest.mark.parametrize("name", sorted(_BOOL_PRODUCTS))
def test_bool_matrix_products_refuse_as_cpu(name):
    error = oi.same_or_refused(_BOOL_PRODUCTS[name], name)
    assert isinstance(error, NotImplementedError), error
    # A refusal, not a missing lowering: the message is the kernel's.
    with pytest.raises(NotImplementedError, match="not implemented for 'Bool'"):
        _BOOL_PRODUCTS[name]("tpu")


def test_bool_outer_product_computes_as_cpu():
    v = torch.tensor([True, False])
    oi.same(lambda s, a, b: torch.addr(s, a, b), _BOOL, v, v)


_FEW_ROWS = [  # (rows, offs over 4 groups): rows <= groups, the gathered form
    (3, [1, 1, 3, 3]),  # an empty group, then the last group empty
    (4, [0, 2, 3, 3]),  # the first group empty, a row past offs[-1]
    (2, [0, 0, 0, 1]),  # a row past offs[-1], the only row in the last group
    (4, [1, 2, 3, 4]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, offs", _FEW_ROWS)
def test_grouped_mm_of_few_rows_as_cpu(rows, offs, dtype):
    # Note [Grouped products of few rows]: each row by its own group's matrix. CPU's
    # kernel leaves rows past offs[-1] unwritten; torchjax's are 0, as ragged_dot's.
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 8, generator=g).to(dtype)
    b = torch.randn(4, 8, 16, generator=g).to(dtype)
    o = torch.tensor(offs, dtype=torch.int32)
    want = torch._grouped_mm(a, b, o)
    got = torch._grouped_mm(a.to("tpu"), b.to("tpu"), o.to("tpu")).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    kept = torch.arange(rows) < offs[-1]
    tol = 0 if dtype == torch.bfloat16 else 1e-6  # one float32 sum rounded once
    torch.testing.assert_close(got[kept], want[kept], rtol=tol, atol=tol)
    assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))


@pytest.mark.parametrize("rows, ragged", [(4, 0), (5, 1)])
def test_grouped_mm_of_few_rows_lowers_without_ragged_dot_on_tpu(rows, ragged):
    # Read from the TPU lowering, on CPU: up to as many rows as groups, a gather and a
    # batched dot_general; more rows, one ragged_dot.
    from tests.pallas.test_lowering import _TPU

    def grouped(a, b, offs):
        return matmul_ops._grouped_mm(a, b, offs)

    args = (jnp.ones((rows, 32), jnp.bfloat16), jnp.ones((4, 32, 64), jnp.bfloat16))
    args += (jnp.arange(1, 5, dtype=jnp.int32),)
    with jax.sharding.use_abstract_mesh(_TPU):
        text = jax.jit(grouped).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"\"chlo.ragged_dot\"\(", text)) == ragged, text
    assert ("stablehlo.gather" in text) == (not ragged), text


@pytest.mark.parametrize(
    "dtype, want", [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")], ids=["bf16", "f32"]
)
def test_grouped_mm_asks_no_precision_of_half_precision_ragged_dot(dtype, want):
    # XLA:TPU runs ragged_dot as a Mosaic kernel, which refuses HIGHEST on bfloat16
    # operands ("Bad lhs type": every bf16 MoE forward crashed on the chip); float32 keeps
    # torch's knob (Note [Kernel matmul precision]). Read from the TPU lowering, on CPU.
    from tests.pallas.test_lowering import _TPU

    def grouped(a, b, offs):
        return matmul_ops._grouped_mm(a, b, offs, precision=matmul_ops.HIGHEST)

    args = (jnp.ones((32, 32), dtype), jnp.ones((4, 32, 64), dtype), jnp.arange(4, dtype=jnp.int32))
    with jax.sharding.use_abstract_mesh(_TPU):
        text = jax.jit(grouped).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    dots = re.findall(r'"chlo.ragged_dot".*?precision_config = \[([^\]]*)\]', text)
    assert len(dots) == 1, text
    assert dots[0] == f"#chlo<precision {want}>, #chlo<precision {want}>"


@pytest.mark.parametrize("op", ["dot", "vdot", "mm", "matmul"])
def test_mixed_dtype_products_refused_with_cpus_text(op):
    a = torch.ones(3) if op in ("dot", "vdot") else torch.ones(2, 3)
    b = torch.ones(3, dtype=torch.float64) if op in ("dot", "vdot") else torch.ones(3, 2).double()
    fn = getattr(torch, op)
    with pytest.raises(RuntimeError) as cpu:
        fn(a, b)
    with pytest.raises(RuntimeError) as got:
        fn(a.to("tpu"), b.to("tpu"))
    assert str(got.value).startswith(str(cpu.value)), (got.value, cpu.value)


def _outcome(call, device):
    """``call(device)``'s result on the host, or its exception's type and text."""
    try:
        return call(device).cpu()
    except (RuntimeError, NotImplementedError, IndexError) as error:
        return error


def _same_outcome(call):
    """CPU and tpu agree: equal values and dtype, or the same exception type with CPU's
    text first (tpu adds the op's name after it)."""
    want, got = _outcome(call, "cpu"), _outcome(call, "tpu")
    if isinstance(want, Exception):
        assert type(got) is type(want), (want, got)
        assert str(got).startswith(str(want)), (want, got)
    else:
        assert not isinstance(got, Exception), (want, got)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _full(shape, dtype):
    return torch.ones(shape, dtype=dtype)


_B, _F, _D, _L = torch.bool, torch.float32, torch.float64, torch.int64
# (self, mat1, mat2) shapes: bad inner sizes, 1-D and 3-D operands, a self that does not
# expand, and the shapes with nothing to multiply.
_ADDMM_SHAPES = [
    ((2, 3), (2, 4), (5, 3)),
    ((2, 5), (2, 4), (4, 3)),
    ((2, 5), (2, 4), (5, 3)),
    ((3,), (4,), (4, 3)),
    ((3,), (2, 4), (4,)),
    ((2, 2, 3), (2, 4), (4, 3)),
    ((7,), (0, 4), (4, 3)),
    ((2, 3), (2, 4), (4, 3)),
    ((1,), (2, 4), (4, 3)),
    ((0, 3), (0, 4), (4, 3)),
    ((2, 0), (2, 4), (4, 0)),
    ((2, 3), (2, 0), (0, 3)),
    ((), (2, 0), (0, 3)),
]
_ADDMM_DTYPES = [(_B, _B, _B), (_L, _L, _L), (_F, _F, _F), (_D, _F, _F), (_F, _F, _D),
                 (_B, _F, _F), (_F, _F, _B), (_L, _L, _B), (_F, _B, _B)]  # fmt: skip


@pytest.mark.parametrize("dtypes", _ADDMM_DTYPES, ids=str)
@pytest.mark.parametrize("shapes", _ADDMM_SHAPES, ids=str)
def test_addmm_checks_in_cpus_order(shapes, dtypes):
    # CPU's addmm checks dtypes, ranks, inner sizes and self's expand before it looks for
    # a kernel of the dtype: a bool call with bad shapes raises the shape error.
    _same_outcome(lambda d: torch.addmm(*(_full(s, t).to(d) for s, t in zip(shapes, dtypes))))


@pytest.mark.parametrize("dtypes", [(_B, _B), (_F, _F), (_L, _B), (_F, _D)], ids=str)
@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 4), (5, 3)),
        ((4,), (4, 3)),
        ((2, 4), (4,)),
        ((2, 4), (4, 3)),
        ((0, 4), (4, 3)),
        ((2, 0), (0, 3)),
    ],  # fmt: skip
    ids=str,
)
def test_mm_checks_in_cpus_order(shapes, dtypes):
    _same_outcome(lambda d: torch.mm(*(_full(s, t).to(d) for s, t in zip(shapes, dtypes))))


@pytest.mark.parametrize("dtype", [_B, _L, _F], ids=str)
@pytest.mark.parametrize(
    "scales",
    [{}, {"beta": 0}, {"beta": 2}, {"beta": 1.5}, {"beta": True}, {"beta": False}, {"alpha": 0}],
    ids=str,
)
def test_addmm_with_nothing_to_multiply_scales_self_as_cpu(dtype, scales):
    # k == 0: CPU computes beta * self with torch's mul, which refuses a beta the result's
    # dtype cannot hold (an int into bool, a float into int64).
    _same_outcome(
        lambda d: torch.addmm(
            _full((2, 3), dtype).to(d),
            _full((2, 0), dtype).to(d),
            _full((0, 3), dtype).to(d),
            **scales,
        )
    )


@pytest.mark.parametrize("dtype", [_B, _F], ids=str)
@pytest.mark.parametrize(
    "call",
    [
        lambda t: t((2, 5)).addmm_(t((2, 4)), t((4, 3))),
        lambda t: t((3,)).addmm_(t((2, 4)), t((4, 3))),
        lambda t: t((2, 5)).addmm_(t((2, 4)), t((5, 3))),
        lambda t: t((2, 3)).addmm_(t((2, 4)), t((4, 3))),
        lambda t: torch.addmm(t((2, 3)), t((2, 4)), t((4, 3)), out=t((2, 3), _D)),
        lambda t: torch.addmm(t((2, 3)), t((2, 4)), t((5, 3)), out=t((2, 3), _D)),
        lambda t: torch.addmm(t((2, 3)), t((2, 4)), t((4, 3)), out=t((2, 3))),
    ],
    ids=[
        "inplace-wide",
        "inplace-1d",
        "inplace-inner",
        "inplace",
        "out-dtype",
        "out-dtype-inner",
        "out",
    ],  # fmt: skip
)
def test_addmm_inplace_and_out_check_in_cpus_order(dtype, call):
    _same_outcome(lambda d: call(lambda s, t=dtype: _full(s, t).to(d)))


_I, _C = torch.int32, torch.complex64
_PAIRS = [(_F, _F), (_F, _D), (_L, _F), (_B, _B), (_B, _F), (_F, _B), (_I, _L), (_C, _F)]
_TRIPLES = [(_F, _F, _F), (_D, _F, _F), (_F, _D, _F), (_F, _F, _D), (_B, _B, _B), (_L, _L, _L),
            (_B, _F, _F), (_F, _C, _C)]  # fmt: skip


def _call(fn, shapes, dtypes, **kw):
    return lambda d: fn(*(_full(s, t).to(d) for s, t in zip(shapes, dtypes)), **kw)


# Every size, rank and dtype check CPU makes, in its order: a bool or mixed call with bad
# shapes raises the shape error; 0-d inputs where CPU reads a size raise its IndexError.
_VECTOR_CALLS = {
    "mv": (torch.mv, [((2, 3), (3,)), ((2, 3), (4,)), ((3,), (3,)), ((), (3,)),
                      ((2, 3), (3, 1)), ((0, 3), (3,)), ((2, 0), (0,))]),
    "dot": (torch.dot, [((3,), (3,)), ((3,), (4,)), ((3, 1), (3,)), ((), ()), ((0,), (0,))]),
    "vdot": (torch.vdot, [((3,), (3,)), ((3,), (4,)), ((3,), (3, 1)), ((0,), (0,))]),
}  # fmt: skip


@pytest.mark.parametrize("dtypes", _PAIRS, ids=str)
@pytest.mark.parametrize(
    "name,shapes",
    [(n, s) for n, (_, cases) in _VECTOR_CALLS.items() for s in cases],
    ids=str,
)
def test_vector_products_check_as_cpu(name, shapes, dtypes):
    _same_outcome(_call(_VECTOR_CALLS[name][0], shapes, dtypes))


_ADD_FORM_CALLS = {
    "addmv": (torch.addmv, [((2,), (2, 3), (3,)), ((), (2, 3), (3,)), ((3,), (2, 3), (3,)),
                            ((2, 2), (2, 3), (3,)), ((2,), (2, 3), (4,)), ((), (2, 3), (4,)),
                            ((2,), (3,), (3,)), ((3,), (2, 0), (0,)), ((2,), (2, 0), (0,))]),
    "baddbmm": (torch.baddbmm, [((2, 3, 5), (2, 3, 4), (2, 4, 5)),
                                ((4, 3, 5), (2, 3, 4), (2, 4, 5)),
                                ((3, 5), (2, 3, 4), (2, 5, 5)),
                                ((2, 3, 5), (2, 3, 4), (2, 4)),
                                ((2, 3, 5), (2, 3, 4, 1), (2, 4, 5)),
                                ((2, 3, 5), (2, 3, 0), (2, 0, 5)),
                                ((0, 3, 5), (0, 3, 4), (0, 4, 5)),
                                ((2, 10, 10), (2, 10, 10), (2, 10, 10))]),
    "addbmm": (torch.addbmm, [((3, 5), (2, 3, 4), (2, 4, 5)), ((2, 3, 5), (2, 3, 4), (2, 4, 5)),
                              ((3, 4), (2, 3, 4), (2, 4, 5)), ((3, 5), (2, 3, 4), (2, 4)),
                              ((3, 5), (2, 3, 4), (3, 4, 5)), ((3, 5), (2, 3, 4), (2, 5, 5)),
                              ((3, 5), (0, 3, 4), (0, 4, 5)), ((3, 5), (2, 3, 0), (2, 0, 5))]),
}  # fmt: skip


@pytest.mark.parametrize("dtypes", _TRIPLES, ids=str)
@pytest.mark.parametrize(
    "name,shapes",
    [(n, s) for n, (_, cases) in _ADD_FORM_CALLS.items() for s in cases],
    ids=str,
)
def test_add_forms_check_as_cpu(name, shapes, dtypes):
    # (2, 10, 10) batches take CPU's large-product path, which words bool and mixed
    # dtypes differently from the small one.
    _same_outcome(_call(_ADD_FORM_CALLS[name][0], shapes, dtypes))


@pytest.mark.parametrize("dtype", [_B, _L, _F, torch.float16], ids=str)
@pytest.mark.parametrize(
    "scales",
    [{"beta": 1.5}, {"beta": 1j}, {"alpha": 1j}, {"beta": 1e300}, {"beta": True}, {"beta": 0}],
    ids=str,
)
@pytest.mark.parametrize(
    "name,shapes",
    [
        ("addmv", ((2,), (2, 3), (3,))),
        ("addmv", ((2,), (2, 0), (0,))),
        ("baddbmm", ((2, 3, 5), (2, 3, 4), (2, 4, 5))),
        ("baddbmm", ((2, 3, 5), (2, 3, 0), (2, 0, 5))),
        ("addbmm", ((3, 5), (2, 3, 4), (2, 4, 5))),
        ("addbmm", ((3, 5), (2, 3, 0), (2, 0, 5))),
        ("addbmm", ((3, 5), (0, 3, 4), (0, 4, 5))),
    ],  # fmt: skip
    ids=str,
)
def test_add_forms_read_their_scales_as_cpu(name, shapes, dtype, scales):
    # alpha and beta are read as the kernel's type (a complex or too large one refused);
    # with nothing to multiply CPU computes beta * self with torch's mul instead.
    _same_outcome(_call(_ADD_FORM_CALLS[name][0], shapes, (dtype,) * 3, **scales))


@pytest.mark.parametrize("dtype", [_B, _L, _F], ids=str)
@pytest.mark.parametrize(
    "call",
    [
        lambda t: t((1,)).addmv_(t((2, 3)), t((3,))),
        lambda t: t((2,)).addmv_(t((2, 3)), t((3,), _D)),
        lambda t: t((2, 1, 5)).baddbmm_(t((2, 3, 4)), t((2, 4, 5))),
        lambda t: t((2, 3, 5)).baddbmm_(t((2, 3, 4)), t((2, 4, 5), _D)),
        lambda t: t((2, 3, 5)).baddbmm_(t((2, 3, 4)), t((2, 5, 5))),
        lambda t: t((3, 4)).addbmm_(t((2, 3, 4)), t((2, 4, 5))),
        lambda t: t((3, 5), _D).addbmm_(t((2, 3, 4)), t((2, 4, 5))),
        lambda t: torch.mv(t((2, 3)), t((3,)), out=t((2,), _D)),
        lambda t: torch.mv(t((2, 3)), t((3,)), out=t((5,), _D)),
        lambda t: torch.mv(t((2, 3)), t((4,)), out=t((2,), _D)),
        lambda t: torch.dot(t((3,)), t((4,)), out=t((), _D)),
        lambda t: torch.vdot(t((3,)), t((3,)), out=t((), _D)),
        lambda t: torch.addmv(t((2,)), t((2, 3)), t((3,)), out=t((2,), _D)),
        lambda t: torch.baddbmm(t((2, 3, 5)), t((2, 3, 4)), t((2, 4, 5)), out=t((2, 3, 5), _D)),
        lambda t: torch.baddbmm(t((2, 3, 5)), t((2, 3, 4)), t((2, 5, 5)), out=t((2, 3, 5), _D)),
        lambda t: torch.addbmm(t((3, 5)), t((2, 3, 4)), t((2, 4, 5)), out=t((3, 5), _D)),
        lambda t: torch.addbmm(t((3, 5)), t((2, 3, 4)), t((2, 5, 5)), out=t((3, 5), _D)),
    ],
    ids=[
        "addmv_-broadcast",
        "addmv_-mixed",
        "baddbmm_-broadcast",
        "baddbmm_-batch2-dtype",
        "baddbmm_-inner",
        "addbmm_-expand",
        "addbmm_-self-dtype",
        "mv-out-dtype",
        "mv-out-size",
        "mv-out-inner",
        "dot-out-inner",
        "vdot-out-dtype",
        "addmv-out-dtype",
        "baddbmm-out-dtype",
        "baddbmm-out-inner",
        "addbmm-out-dtype",
        "addbmm-out-inner",
    ],  # fmt: skip
)
def test_vector_and_batched_written_forms_check_as_cpu(dtype, call):
    _same_outcome(lambda d: call(lambda s, t=dtype: _full(s, t).to(d)))


_SHAPE_ERRORS = {
    "mv": (torch.mv, ((2, 3), (4,))),
    "mv rank": (torch.mv, ((3,), (3,))),
    "dot": (torch.dot, ((3,), (4,))),
    "vdot rank": (torch.vdot, ((3, 1), (3,))),
    "addmv": (torch.addmv, ((2,), (2, 3), (4,))),
    "baddbmm": (torch.baddbmm, ((2, 3, 5), (2, 3, 4), (2, 5, 5))),
    "baddbmm expand": (torch.baddbmm, ((4, 3, 5), (2, 3, 4), (2, 4, 5))),
    "addbmm": (torch.addbmm, ((3, 5), (2, 3, 4), (2, 5, 5))),
    "addbmm expand": (torch.addbmm, ((3, 4), (2, 3, 4), (2, 4, 5))),
}


@pytest.mark.parametrize("name", sorted(_SHAPE_ERRORS))
def test_shape_errors_under_jit_and_compile_as_cpu(name):
    fn, shapes = _SHAPE_ERRORS[name]
    args = [torch.ones(s) for s in shapes]
    with pytest.raises(RuntimeError) as cpu:
        fn(*args)
    with pytest.raises(RuntimeError) as jitted:
        torchjax.jit(fn)(*(a.to("tpu") for a in args))
    assert type(jitted.value) is RuntimeError
    assert str(jitted.value).startswith(str(cpu.value)), (jitted.value, cpu.value)
    # CPU's torch.compile raises the error while Dynamo propagates fake tensors, wrapped
    # in its TorchRuntimeError; ours wraps eager's error, CPU's text, the same way.
    compiled = []
    for device, backend in (("cpu", "eager"), ("tpu", "tpu")):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError) as info:
            torch.compile(lambda *a: fn(*a), backend=backend)(*(a.to(device) for a in args))
        compiled.append(info.value)
    assert type(compiled[1]) is type(compiled[0]), compiled
    assert str(cpu.value) in str(compiled[1])
