"""torchjax.pallas.op: a Pallas kernel as a torch.library op (eager, autograd, FakeTensor,
torchjax.jit, torch.compile)."""

import jax
import jax.extend
import pytest
import torch
from jax.experimental import pallas as pl
from torch._subclasses.fake_tensor import FakeTensorMode

import torchjax
from torchjax import pallas as tp


def _fma_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * y_ref[...] + 1


@jax.custom_vjp
def _fma(x, y):
    return pl.pallas_call(
        _fma_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=tp.interpret_default(),
    )(x, y)


_fma.defvjp(lambda x, y: (_fma(x, y), (x, y)), lambda res, g: (g * res[1], g * res[0]))


@tp.op("torchjax_test::fma_scaled")
def fma_scaled(x, y, scale=2.0):
    return _fma(x, y) * scale


@tp.op("torchjax_test::two_out", outputs=2)
def two_out(x):
    return x * 2, x.sum(axis=0)


def _inputs():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return x, y


def test_schema_inferred_from_signature():
    assert str(fma_scaled.op._schema) == (
        "torchjax_test::fma_scaled(Tensor x, Tensor y, float scale=2.) -> Tensor"
    )
    assert fma_scaled.op is torch.ops.torchjax_test.fma_scaled.default


def test_eager_forward_and_backward_match_cpu():
    x, y = _inputs()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    xt, yt = x.to("tpu").requires_grad_(), y.to("tpu").requires_grad_()
    out = fma_scaled(xt, yt, 3.0)
    ref = (xc * yc + 1) * 3.0
    torch.testing.assert_close(out.cpu(), ref.detach())
    assert out.device.type == "tpu"
    (out * out).sum().backward()
    (ref * ref).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    torch.testing.assert_close(yt.grad.cpu(), yc.grad)


def test_multiple_outputs():
    x, _ = _inputs()
    a, b = two_out(x.to("tpu"))
    torch.testing.assert_close(a.cpu(), x * 2)
    torch.testing.assert_close(b.cpu(), x.sum(0))


def test_fake_tensor_shapes_from_eval_shape():
    with FakeTensorMode():
        a, b = two_out(torch.empty(4, 8))
        c = fma_scaled(torch.empty(3, 5), torch.empty(3, 5))
    assert (a.shape, b.shape, c.shape) == ((4, 8), (8,), (3, 5))


def test_inside_torchjax_jit_and_torch_compile():
    x, y = _inputs()
    ref = (x * y + 1) * 2.0
    f = torchjax.jit(lambda a, b: fma_scaled(a, b).sin())
    torch.testing.assert_close(f(x.to("tpu"), y.to("tpu")).cpu(), ref.sin())
    c = torch.compile(lambda a, b: fma_scaled(a, b).cos(), backend="tpu")
    torch.testing.assert_close(c(x.to("tpu"), y.to("tpu")).cpu(), ref.cos())


def test_torch_compile_training_uses_the_custom_vjp():
    x, y = _inputs()
    xc = x.clone().requires_grad_()
    ((xc * y + 1) * 2.0).cos().sum().backward()
    xt = x.to("tpu").requires_grad_()
    c = torch.compile(lambda a, b: fma_scaled(a, b).cos().sum(), backend="tpu")
    c(xt, y.to("tpu")).backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)


def test_unsupported_default_names_the_parameter():
    with pytest.raises(ValueError, match="parameter 'shape'"):

        @tp.op("torchjax_test::bad")
        def bad(x, shape=(1, 2)):
            return x


_RUNS = []


@tp.op("torchjax_test::counted_sin", outputs=2)
def counted_sin(x, scale=2.0):
    # ordered: XLA may duplicate or drop an unordered callback (XLA:TPU ran it twice)
    jax.debug.callback(lambda: _RUNS.append(1), ordered=True)
    return jax.numpy.sin(x) * scale, jax.numpy.argmax(x, axis=0)


def test_eager_backward_reuses_the_forward_residuals():
    # Note [Kernel op backward]: the forward keeps its pullback; backward does not run
    # the function again.
    x = torch.randn(4, 8)
    xt = x.to("tpu").requires_grad_()
    _RUNS.clear()
    out, idx = counted_sin(xt, 3.0)
    assert not hasattr(out, "_torchjax_kernel_vjp")  # moved into the autograd context
    jax.effects_barrier()
    assert len(_RUNS) == 1
    (out * out).sum().backward()
    jax.effects_barrier()
    assert len(_RUNS) == 1
    xc = x.clone().requires_grad_()
    ((xc.sin() * 3.0) ** 2).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    # JAX's 32-bit mode, as the function would run in JAX (Note [A kernel op's JAX mode])
    assert idx.dtype == torch.int32
    torch.testing.assert_close(idx.cpu(), x.argmax(0).int())
    with torch.no_grad():  # no gradient wanted: the plain call, nothing kept
        out, _ = counted_sin(xt)
    assert out.grad_fn is None and not hasattr(out, "_torchjax_kernel_vjp")
    # the no_grad call's callback may still be in flight (dispatch is asynchronous on a
    # TPU): let it land before the count starts again
    jax.effects_barrier()
    _RUNS.clear()
    out, _ = torch.ops.torchjax_test.counted_sin(xt)  # the op itself: backward recomputes
    out.sum().backward()
    jax.effects_barrier()
    assert len(_RUNS) == 2


@tp.op("torchjax_test::take_rows", outputs=2)
def take_rows(table, ids):
    return table[ids], jax.numpy.arange(3)


@tp.op("torchjax_test::take_rows_x64", outputs=2, x64=True)
def take_rows_x64(table, ids):
    return table[ids], jax.numpy.arange(3)


def test_64_bit_floats_are_refused_in_32_bit_mode():
    # JAX's 32-bit mode would round a float64: refused, with the argument and the two
    # ways out named; the fake implementation refuses alike.
    table = torch.randn(5, 3, device="tpu")
    ids = torch.tensor([4, 0], device="tpu")
    with pytest.raises(
        TypeError,
        match=r"take_rows: argument 'table' is a \(5, 3\) torch.float64.*"
        r"table\.to\(torch.float32\).*x64=True",
    ):
        take_rows(table.double(), ids)
    with FakeTensorMode(), pytest.raises(TypeError, match="argument 'table'"):
        take_rows(torch.empty(5, 3, dtype=torch.float64), torch.empty(2, dtype=torch.long))


def test_int64_arguments_arrive_as_int32_checked_on_the_device():
    # torch's int64 indices arrive as the int32 a 32-bit function expects; a value that
    # does not fit raises at the next sync, naming the op and the value.
    table = torch.randn(5, 3, device="tpu")
    rows, r = take_rows(table, torch.tensor([4, 0], device="tpu"))
    torch.testing.assert_close(rows.cpu(), table.cpu()[[4, 0]])
    assert r.dtype == torch.int32  # jnp.arange in JAX's default mode
    bad = torch.tensor([1, 2**33 + 1], device="tpu")
    with pytest.raises(
        RuntimeError,
        match=r"torchjax_test::take_rows: value 8589934593 of the int64 argument .ids. does not "
        r"fit the int32.*x64=True",
    ):
        take_rows(table, bad)[0].cpu()


def test_x64_ops_trace_with_64_bit_types():
    table = torch.randn(5, 3, device="tpu", dtype=torch.float64)
    ids = torch.tensor([2**33 % 5, 1], device="tpu")
    rows, r = take_rows_x64(table, ids)
    assert rows.dtype == torch.float64 and r.dtype == torch.int64
    torch.testing.assert_close(rows.cpu(), table.cpu()[ids.cpu()])


@tp.op("torchjax_test::square_x64", x64=True)
def square_x64(x):
    return x * x


def test_x64_op_float64_backward_stays_float64():
    # The eager backward cast the cotangent outside x64: float32 where float64 was due,
    # and the pullback refused it.
    x = torch.randn(3, dtype=torch.float64)
    t = x.to("tpu").requires_grad_()
    square_x64(t).sum().backward()
    assert t.grad.dtype == torch.float64
    torch.testing.assert_close(t.grad.cpu(), 2 * x)


@tp.op("torchjax_test::cube")
def cube(x):
    return x * x * x


def test_complex_gradients_follow_torchs_convention():
    # Note [Complex cotangents]: they came back conjugated, in every mode.
    z = torch.randn(4, dtype=torch.complex64)
    zc = z.clone().requires_grad_()
    (zc**3).real.sum().backward()
    calls = {
        "op": lambda a: cube(a),
        "torch.ops": lambda a: torch.ops.torchjax_test.cube(a),
    }
    for name, call in calls.items():
        zt = z.to("tpu").requires_grad_()
        call(zt).real.sum().backward()
        torch.testing.assert_close(zt.grad.cpu(), zc.grad, atol=1e-5, rtol=1e-5, msg=name)
    zt = z.to("tpu").requires_grad_()
    torch.compile(lambda a: cube(a).real.sum(), backend="tpu")(zt).backward()
    torch.testing.assert_close(zt.grad.cpu(), zc.grad, atol=1e-5, rtol=1e-5)


@tp.op("torchjax_test::add_k")
def add_k(x, k=3):
    return x + k


def test_a_python_int_past_int32_is_refused_in_32_bit_mode():
    x = torch.ones(2, device="tpu")
    with pytest.raises(TypeError, match=r"add_k: argument 'k' is 2147483648, past the int32"):
        add_k(x, 2**31)
    torch.testing.assert_close(add_k(x, 2**31 - 1).cpu(), torch.full((2,), 2.0**31))


def test_a_matmul_precision_reaches_a_custom_vjp_backward_traced_later():
    # tokamax's TPU attention takes no precision in its products: its wrapper enters
    # jax.default_matmul_precision, which must reach the forward and the backward that
    # an outer jax.vjp traces after the call returned (Note [Kernel matmul precision]).
    from torchjax.pallas._jax_mode import in_32bit_mode

    @jax.custom_vjp
    def product(a, b):
        return a @ b

    def fwd(a, b):
        return a @ b, (a, b)

    def bwd(res, g):
        a, b = res
        return g @ b.T, a.T @ g

    product.defvjp(fwd, bwd)
    run = in_32bit_mode(product, matmul_precision="highest")
    a = jax.numpy.ones((8, 8))

    def precisions(fn):
        jaxpr = jax.make_jaxpr(fn)(a, a)
        found = []

        def walk(j):
            for eqn in j.eqns:
                if eqn.primitive.name == "dot_general":
                    found.append(eqn.params["precision"])
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr.jaxpr)
        return found

    grad = jax.grad(lambda x, y: run(x, y).sum(), argnums=(0, 1))
    for got in (precisions(run), precisions(grad)):
        assert got and all(
            p == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) for p in got
        ), got
    plain = precisions(jax.grad(lambda x, y: in_32bit_mode(product)(x, y).sum()))
    assert plain and all(p is None for p in plain), plain


@tp.op("torchjax_test::sum_list", schema="(Tensor[] xs, float scale=1.0) -> Tensor")
def sum_list(xs, scale=1.0):
    return sum(x * scale for x in xs)


def test_tensor_list_arguments_run_refuse_float64_and_gradients_clearly():
    a, b = torch.randn(3), torch.randn(3)
    got = sum_list([a.to("tpu"), b.to("tpu")], 2.0)
    torch.testing.assert_close(got.cpu(), (a + b) * 2.0)
    # A float64 element was rounded to float32 silently (32-bit mode), dtype and all.
    wide = torch.tensor([1 / 3, 1e-20], dtype=torch.float64).to("tpu")
    with pytest.raises(TypeError, match=r"argument 'xs\[1\]' is a \(2,\) torch.float64"):
        sum_list([a[:2].to("tpu"), wide])
    # Gradients through a Tensor[] argument crashed inside autograd's backward.
    x = a.to("tpu").requires_grad_()
    with pytest.raises(NotImplementedError, match="'xs' is a list of tensors"):
        sum_list([x, x * 2])
    with torch.no_grad():
        torch.testing.assert_close(sum_list([x, x * 2]).cpu(), a * 3)


# -- a function JAX cannot differentiate (Note [A kernel op without a derivative]) ----------
def _kernel_fma(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * y_ref[...] + x_ref[...]


def _pallas_fma(x, y):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(_kernel_fma, out_shape=out, interpret=tp.interpret_default())(x, y)


@tp.op("torchjax_test_op::no_vjp_fma")
def _no_vjp_fma(x, y, scale=2.0):
    return _pallas_fma(x, y) * scale


@pytest.mark.parametrize("how", ["eager", "direct", "jit", "compile"])
def test_op_without_derivative_runs_forward_and_refuses_backward(how):
    a = torch.randn(8, 128, requires_grad=True)
    b = torch.randn(8, 128)
    at, bt = a.detach().to("tpu").requires_grad_(), b.to("tpu")
    calls = {
        "eager": lambda x, y: _no_vjp_fma(x, y, 3.0),
        "direct": lambda x, y: torch.ops.torchjax_test_op.no_vjp_fma(x, y, 3.0),
        "jit": torchjax.jit(lambda x, y: _no_vjp_fma(x, y, 3.0)),
        "compile": torch.compile(lambda x, y: _no_vjp_fma(x, y, 3.0), backend="tpu"),
    }
    out = calls[how](at, bt)
    assert out.requires_grad
    torch.testing.assert_close(out.detach().cpu(), ((a * b + a) * 3.0).detach())
    with pytest.raises(RuntimeError, match=r"backward through torchjax_test_op\.no_vjp_fma") as e:
        out.sum().backward()
    assert "jax.custom_vjp" in str(e.value) and "docs/kernels.md" in str(e.value)


def test_op_without_derivative_backward_inside_jit():
    def step(x, y):
        out = _no_vjp_fma(x, y, 3.0)
        out.sum().backward()
        return out

    at = torch.randn(8, 128, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match=r"backward through torchjax_test_op\.no_vjp_fma"):
        torchjax.jit(step)(at, torch.randn(8, 128, device="tpu"))
