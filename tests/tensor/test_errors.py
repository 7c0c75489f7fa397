"""Bad input gives torch's exception type on tpu, with a message naming the op.

Each case runs on CPU and on tpu: the exception types must be equal (and equal to the
table's, so a case CPU stopped refusing is noticed), and the tpu message must name the op
(Note [One error layer] in torchjax/tensor/_errors.py). Device-side checks raise at the
next sync, so the cases that need one end in ``.cpu()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax import DataDependentError, LeakedTracerError


def r(dev, *shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype, device=dev)


def i64(dev, *values):
    return torch.tensor(values, dtype=torch.int64, device=dev)


def overlapping_out(dev):
    x = torch.zeros(6, device=dev)
    torch.add(x[:3], 1, out=x[1:4])


def expanded_inplace(dev):
    torch.zeros(1, device=dev).expand(3).add_(1)


def cat_into_input(dev):
    x = torch.ones(6, device=dev)
    torch.cat([x[:2]], out=x[1:3])


# (id, call, expected exception type, words the tpu message must contain; None: torch
# refuses the call itself before any op reaches tpu, so the text must be CPU's, verbatim)
CASES = [
    # shapes
    ("add-broadcast", lambda d: r(d, 4) + r(d, 3), RuntimeError, "aten::add"),
    ("mul-broadcast-2d", lambda d: r(d, 2, 3) * r(d, 3, 2), RuntimeError, "aten::mul"),
    ("matmul-inner", lambda d: r(d, 2, 3) @ r(d, 4, 5), RuntimeError, "aten::"),
    ("mm-1d", lambda d: torch.mm(r(d, 3), r(d, 3, 3)), RuntimeError, "aten::mm"),
    ("bmm-batch", lambda d: torch.bmm(r(d, 2, 3, 4), r(d, 3, 4, 5)), RuntimeError, "aten::bmm"),
    ("cat-sizes", lambda d: torch.cat([r(d, 2, 3), r(d, 3, 4)]), RuntimeError, "aten::cat"),
    ("stack-sizes", lambda d: torch.stack([r(d, 2), r(d, 3)]), RuntimeError, "aten::"),
    ("view-numel", lambda d: r(d, 6).view(4), RuntimeError, "aten::view"),
    ("reshape-numel", lambda d: r(d, 6).reshape(4, 2), RuntimeError, "aten::"),
    ("expand-size", lambda d: r(d, 3).expand(4), RuntimeError, "aten::expand"),
    (
        "where-broadcast",
        lambda d: torch.where(r(d, 3) > 0, r(d, 4), r(d, 3)),
        RuntimeError,
        "aten::where",
    ),
    ("linear-features", lambda d: F.linear(r(d, 2, 3), r(d, 4, 5)), RuntimeError, "aten::"),
    (
        "conv2d-channels",
        lambda d: F.conv2d(r(d, 1, 3, 5, 5), r(d, 2, 4, 3, 3)),
        RuntimeError,
        "aten::",
    ),
    ("layer-norm-shape", lambda d: F.layer_norm(r(d, 2, 5), (4,)), RuntimeError, "aten::"),
    (
        "index-select-2d-index",
        lambda d: r(d, 4).index_select(0, i64(d, 0).view(1, 1)),
        IndexError,
        "aten::index_select",
    ),
    ("view-two-inferred", lambda d: r(d, 6).view(-1, -1), RuntimeError, "aten::view"),
    # dims
    ("sum-dim", lambda d: r(d, 2, 2).sum(3), IndexError, "aten::sum"),
    ("softmax-dim", lambda d: r(d, 2, 2).softmax(5), IndexError, "aten::_softmax"),
    ("flip-repeated-dim", lambda d: r(d, 2, 2).flip(0, 0), RuntimeError, "aten::flip"),
    ("transpose-dim", lambda d: r(d, 2, 2).transpose(0, 2), IndexError, "aten::transpose"),
    ("cat-dim", lambda d: torch.cat([r(d, 2), r(d, 2)], 1), IndexError, "aten::cat"),
    ("squeeze-dim", lambda d: r(d, 2, 1).squeeze(3), IndexError, "aten::squeeze"),
    ("cumsum-dim", lambda d: r(d, 3).cumsum(1), IndexError, "aten::cumsum"),
    ("gather-dim", lambda d: r(d, 3).gather(1, i64(d, 0)), IndexError, "aten::gather"),
    ("topk-k", lambda d: r(d, 3).topk(5), RuntimeError, "aten::topk"),
    ("narrow-start", lambda d: r(d, 3).narrow(0, 2, 4), RuntimeError, None),
    ("unbind-dim", lambda d: r(d, 3).unbind(2), IndexError, "aten::unbind"),
    # dtypes
    (
        "bitwise-float",
        lambda d: torch.bitwise_and(r(d, 3), r(d, 3)),
        NotImplementedError,
        "aten::bitwise_and",
    ),
    (
        "int-add-float-inplace",
        lambda d: r(d, 3, dtype=torch.int64).add_(1.5),
        RuntimeError,
        "aten::add_",
    ),
    ("float-index", lambda d: r(d, 3)[r(d, 1)], IndexError, "aten::index"),
    (
        "mm-dtypes",
        lambda d: torch.mm(r(d, 2, 2), r(d, 2, 2, dtype=torch.float64)),
        RuntimeError,
        "aten::mm",
    ),
    (
        "embedding-float-indices",
        lambda d: F.embedding(r(d, 2), r(d, 4, 3)),
        RuntimeError,
        "aten::embedding",
    ),
    (
        "cross-entropy-target-shape",
        lambda d: F.cross_entropy(r(d, 2, 3), i64(d, 0, 1, 2)),
        ValueError,
        None,
    ),
    # devices
    (
        "device-mismatch",
        lambda d: r(d, 3) + r("cpu" if d == "tpu" else "meta", 3),
        RuntimeError,
        "tpu",
    ),
    # out=
    (
        "out-float-to-long",
        lambda d: torch.add(r(d, 2), r(d, 2), out=r(d, 2, dtype=torch.int64)),
        RuntimeError,
        "aten::add",
    ),
    (
        "maximum-out-bool",
        lambda d: torch.maximum(r(d, 2), r(d, 2), out=r(d, 2, dtype=torch.bool)),
        RuntimeError,
        "aten::maximum",
    ),
    (
        "nonzero-out-float",
        lambda d: torch.nonzero(r(d, 2), out=r(d, 2, 1)),
        RuntimeError,
        "aten::nonzero",
    ),
    (
        "mm-out-dtype",
        lambda d: torch.mm(r(d, 2, 2), r(d, 2, 2), out=r(d, 2, 2, dtype=torch.int32)),
        RuntimeError,
        "aten::mm",
    ),
    # negative and inconsistent sizes
    ("empty-negative", lambda d: torch.empty(-1, device=d), RuntimeError, "negative dimension -1"),
    ("zeros-negative", lambda d: torch.zeros(2, -3, device=d), RuntimeError, "zeros"),
    ("randn-negative", lambda d: torch.randn(-2, device=d), RuntimeError, "negative dimension -2"),
    (
        "full-negative",
        lambda d: torch.full((-1,), 1.0, device=d),
        RuntimeError,
        "negative dimension -1",
    ),
    (
        "empty-strided-negative",
        lambda d: torch.empty_strided((2, -1), (1, 1), device=d),
        RuntimeError,
        "negative dimension",
    ),
    ("arange-step-sign", lambda d: torch.arange(5, 0, 1, device=d), RuntimeError, "arange"),
    # overlapping writes
    ("overlapping-out", overlapping_out, RuntimeError, "aten::add"),
    ("expanded-inplace", expanded_inplace, RuntimeError, "aten::add_"),
    ("cat-into-input", cat_into_input, RuntimeError, "aten::cat"),
    # indices (device-side checks raise at the sync)
    ("index-out-of-bounds", lambda d: r(d, 4)[10], IndexError, None),
    (
        "index-select-range",
        lambda d: r(d, 4).index_select(0, i64(d, 7)).cpu(),
        IndexError,
        "aten::index_select",
    ),
    (
        "embedding-range",
        lambda d: F.embedding(i64(d, 9), r(d, 4, 3)).cpu(),
        IndexError,
        "aten::embedding",
    ),
    ("gather-range", lambda d: r(d, 3).gather(0, i64(d, 5)).cpu(), RuntimeError, "aten::gather"),
    # values torch refuses that a lowering would otherwise read silently (negative
    # indices wrapped, clipped or padded past the edge)
    (
        "nll-negative-target",
        lambda d: F.cross_entropy(r(d, 4, 5), i64(d, 1, -1, 3, -1)).cpu(),
        IndexError,
        "Target -1",
    ),
    (
        "nll-target-past-classes",
        lambda d: F.nll_loss(r(d, 2, 3), i64(d, 0, 3)).cpu(),
        IndexError,
        "Target 3",
    ),
    (
        "gather-negative",
        lambda d: r(d, 3).gather(0, i64(d, -1)).cpu(),
        RuntimeError,
        "aten::gather",
    ),
    (
        "scatter-negative",
        lambda d: r(d, 3).scatter(0, i64(d, -1), 5.0).cpu(),
        RuntimeError,
        "aten::scatter",
    ),
    (
        "index-select-negative",
        lambda d: r(d, 3).index_select(0, i64(d, -1)).cpu(),
        IndexError,
        "aten::index_select",
    ),
    (
        "index-add-negative",
        lambda d: r(d, 3).index_add(0, i64(d, -1), r(d, 1)).cpu(),
        IndexError,
        "aten::index_add",
    ),
    (
        "index-copy-negative",
        lambda d: r(d, 3).index_copy(0, i64(d, -1), r(d, 1)).cpu(),
        IndexError,
        "aten::index_copy",
    ),
    (
        "take-along-dim-negative",
        lambda d: torch.take_along_dim(r(d, 3), i64(d, -1)).cpu(),
        RuntimeError,
        "aten::",
    ),
    (
        "embedding-bag-range",
        lambda d: F.embedding_bag(i64(d, 9), r(d, 5, 3), i64(d, 0))[0].cpu(),
        RuntimeError,
        "aten::_embedding_bag",
    ),
    (
        "reflect-pad-too-wide",
        lambda d: F.pad(r(d, 1, 1, 3), (3, 3), mode="reflect"),
        RuntimeError,
        "aten::reflection_pad1d",
    ),
    (
        "repeat-interleave-negative",
        lambda d: torch.arange(2, device=d).repeat_interleave(i64(d, 1, -1)),
        RuntimeError,
        "aten::repeat_interleave",
    ),
    (
        "conv-kernel-past-input",
        lambda d: F.conv2d(r(d, 1, 1, 3, 3), r(d, 2, 1, 5, 5)),
        RuntimeError,
        "aten::convolution",
    ),
]


def _raised(call, dev):
    with pytest.raises(Exception) as info:
        call(dev)
    return info.value


@pytest.mark.parametrize("call,expected,words", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input_raises_torchs_type_naming_the_op(call, expected, words):
    on_cpu = _raised(call, "cpu")
    assert type(on_cpu) is expected, f"CPU raised {type(on_cpu).__name__}: {on_cpu}"
    on_tpu = _raised(call, "tpu")
    assert isinstance(on_tpu, expected), f"tpu raised {type(on_tpu).__name__}: {on_tpu}"
    if words is None:
        assert str(on_tpu) == str(on_cpu)
    else:
        assert words in str(on_tpu), str(on_tpu)
    # Nothing of JAX's own types leaks; JAX's exception, if any, is the cause.
    assert not type(on_tpu).__module__.startswith("jax")


def test_the_table_is_large_enough():
    assert len(CASES) >= 40


def test_a_jax_error_is_chained_as_the_cause():
    error = _raised(lambda d: r(d, 4) + r(d, 3), "tpu")
    assert "at non-singleton dimension" in str(error) or "broadcast" in str(error)
    assert error.__cause__ is not None
    assert "Incompatible shapes" in str(error.__cause__)


def test_a_lowering_gap_says_so_and_names_the_call():
    # A call torch accepts whose lowering fails is torchjax's gap, not the user's error.
    from torchjax.tensor import _errors

    class _Op:
        _opname, _overloadname = "frobnicate", "default"

    try:
        import jax.numpy as jnp

        jnp.zeros(3) + jnp.zeros(4)
    except (TypeError, ValueError) as jax_error:
        error = _errors.translate(_Op(), (r("tpu", 3),), {}, jax_error)
    assert type(error) is RuntimeError
    assert "aten::frobnicate.default(Tensor[float32, (3,)] on tpu:0)" in str(error)
    assert "JAX refused it" in str(error)


_PARTS = [torch.ones(2), torch.ones(3)]
LAYOUT_CASES = [
    ("nested-device", lambda: torch.nested.nested_tensor(_PARTS, device="tpu")),
    ("nested-of-tpu-tensors", lambda: torch.nested.nested_tensor([p.to("tpu") for p in _PARTS])),
    ("as-nested-device", lambda: torch.nested.as_nested_tensor(_PARTS, device="tpu")),
    ("nested-to-tpu", lambda: torch.nested.as_nested_tensor(_PARTS).to("tpu")),
    (
        "jagged-device",
        lambda: torch.nested.nested_tensor(
            [torch.ones(2, 3), torch.ones(3, 3)], layout=torch.jagged, device="tpu"
        ),
    ),
    (
        "from-jagged",
        lambda: torch.nested.nested_tensor_from_jagged(
            torch.ones(5, 3, device="tpu"), torch.tensor([0, 2, 5], device="tpu")
        ),
    ),
]


@pytest.mark.parametrize("make", [pytest.param(c[1], id=c[0]) for c in LAYOUT_CASES])
def test_nested_tensors_are_refused_when_made(make):
    # On CPU these are nested tensors; tpu holds strided tensors only (Note [Unsupported
    # layouts]), so the reference is torch's type for an unsupported backend.
    with pytest.raises(NotImplementedError, match="not supported on device 'tpu'"):
        make()


def test_cpu_nested_tensors_are_untouched():
    nt = torch.nested.nested_tensor(_PARTS)
    assert nt.is_nested and (nt + 1).unbind()[1].tolist() == [2.0, 2.0, 2.0]


def test_sparse_tensors_are_refused_when_made():
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported"):
        torch.sparse_coo_tensor(
            torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,), device="tpu"
        )


# ---------------------------------------------------------------------------------------
# data-dependent Python under torchjax.jit


def _branch(x):
    if x.sum() > 0:
        return x + 1
    return x - 1


def _item(x):
    return x * x.sum().item()


def _int(x):
    return x[: int(x.argmax())]


def _mask(x):
    return x[x > 0]


def _nonzero(x):
    return torch.nonzero(x)


def _masked_select(x):
    return torch.masked_select(x, x > 0)


def _unique(x):
    return torch.unique(x)


def _tolist(x):
    return torch.tensor(x.tolist())


def _print(x):
    print(x)
    return x


def _format(x):
    return x * float(f"{x.sum():.1f}")


TRACE_CASES = [
    ("print", _print, "print(x)", "torchjax.debug_print"),
    ("f-string", _format, 'f"{x.sum():.1f}"', "print(t.shape, t.dtype) works there"),
    ("if-on-a-value", _branch, "if x.sum() > 0:", "torch.where"),
    ("item", _item, "x.sum().item()", "torch.where"),
    ("int", _int, "int(x.argmax())", "outside the traced function"),
    ("bool-mask-index", _mask, "x[x > 0]", "torch.where(mask, x, 0)"),
    ("nonzero", _nonzero, "torch.nonzero(x)", "nonzero_static"),
    ("masked-select", _masked_select, "torch.masked_select(x, x > 0)", "masked reduction"),
    ("unique", _unique, "torch.unique(x)", "fixed shapes"),
    ("tolist", _tolist, "x.tolist()", "torch.where"),
]


@pytest.mark.parametrize("fn,line,advice", [pytest.param(*c[1:], id=c[0]) for c in TRACE_CASES])
def test_data_dependent_python_under_jit_names_the_op_the_line_and_the_fix(fn, line, advice):
    x = torch.arange(-2.0, 3.0, device="tpu")
    fn(x.cpu())  # the function is fine eagerly
    with pytest.raises(DataDependentError) as info:
        torchjax.jit(fn)(x)
    text = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "aten::" in text, text
    assert __file__ in text and line in text, text
    assert advice in text, text
    assert info.value.__cause__ is not None


def test_a_leaked_traced_tensor_is_named():
    import jax
    import jax.numpy as jnp

    kept = []

    def keep(a):
        x = torchjax.from_jax(a)
        kept.append(x * 3)  # an intermediate kept past the trace: a dead tracer
        return torchjax.to_jax(x * 2)

    jax.jit(keep)(jnp.ones(3))
    with pytest.raises(LeakedTracerError) as info:
        kept[0] + 1
    text = str(info.value)
    assert "aten::add" in text and "return it from the traced function" in text, text
    assert __file__ in text, text


BROADCAST_CASES = [
    ("add", lambda d: r(d, 3) + r(d, 4)),
    ("sub-2d", lambda d: r(d, 2, 3) - r(d, 4, 1, 2)),
    ("where", lambda d: torch.where(r(d, 3) > 0, r(d, 4), 0.0)),
    ("maximum", lambda d: torch.maximum(r(d, 3), r(d, 2))),
    ("addcmul", lambda d: torch.addcmul(r(d, 3), r(d, 2), r(d, 3))),
    ("lerp", lambda d: torch.lerp(r(d, 3), r(d, 2), 0.5)),
    ("eq", lambda d: r(d, 5, 3) == r(d, 2, 1)),
]


@pytest.mark.parametrize("call", [pytest.param(c[1], id=c[0]) for c in BROADCAST_CASES])
def test_shapes_that_do_not_broadcast_get_cpus_text(call):
    on_cpu, on_tpu = _raised(call, "cpu"), _raised(call, "tpu")
    assert type(on_tpu) is type(on_cpu) is RuntimeError
    assert str(on_cpu).startswith("The size of tensor a")
    assert str(on_tpu).startswith(str(on_cpu) + " (in aten::"), str(on_tpu)


def test_debug_print_prints_values_in_eager_and_at_every_compiled_run(capfd):
    # Note [Printing inside a traced function]: the advice of the message above works.
    import jax

    @torchjax.jit
    def step(x):
        y = x * 2
        torchjax.debug_print("y = {} mean {m}", y, m=y.mean())
        return y

    step(torch.arange(3.0, device="tpu"))
    step(torch.ones(3, device="tpu"))  # same program: it prints again, the new values
    torchjax.debug_print("eager {} {}", torch.tensor([1, 2], device="tpu"), "text")
    jax.effects_barrier()
    lines = capfd.readouterr().out.splitlines()
    assert lines == ["y = [0. 2. 4.] mean 2.0", "y = [2. 2. 2.] mean 2.0", "eager [1 2] text"]


def test_indexing_with_a_0d_tensor_under_jit_says_how_to_index_on_the_device():
    # torch's x[i] reads a 0-d integer index with .item() in C++: the user wrote no read.
    def pick(x, i):
        return x[i]

    x, i = torch.arange(5.0, device="tpu"), torch.tensor(2, device="tpu")
    with pytest.raises(DataDependentError, match=r"x\[i.reshape\(1\)\]"):
        torchjax.jit(pick)(x, i)
    fixed = torchjax.jit(lambda x, i: x[i.reshape(1)])
    assert fixed(x, i).cpu().tolist() == [2.0]
