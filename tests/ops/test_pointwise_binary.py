"""OpInfo sweep and direct tests for torchjax/ops/pointwise_binary.py (pow: test_power.py;
comparisons, min/max, clamp, where: test_comparison.py)."""

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests

OPS = [
    "add",
    "sub",
    "rsub",
    "mul",
    "div.no_rounding_mode",
    "div.trunc_rounding",
    "div.floor_rounding",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "atan2",
    "hypot",
    "copysign",
    "xlogy",
    "special.xlog1py",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bitwise_left_shift",
    "bitwise_right_shift",
    "logical_and",
    "logical_or",
    "logical_xor",
    "logaddexp",
    "logaddexp2",
    "__radd__",
    "__rsub__",
    "__rmul__",
    "__rdiv__",
    "__rmod__",
    "__rand__",
    "__ror__",
    "__rxor__",
    "float_power",
    "heaviside",
    "ldexp",
    "gcd",
    "lcm",
    "nextafter",
]
globals().update(make_tests(OPS))


def tpu(t):
    return t.to("tpu")


def _same(got, expected):
    assert got.device.type == "tpu"
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


def test_int_division_semantics():
    a = torch.tensor([7, -7, 7, -7, 2**40 + 3, 0])
    b = torch.tensor([2, 2, -2, -2, 3, 5])
    for mode in (None, "trunc", "floor"):
        _same(torch.div(tpu(a), tpu(b), rounding_mode=mode), torch.div(a, b, rounding_mode=mode))
    _same(torch.remainder(tpu(a), tpu(b)), torch.remainder(a, b))
    _same(torch.fmod(tpu(a), tpu(b)), torch.fmod(a, b))
    _same(tpu(a) // 3, a // 3)
    _same(tpu(a) % -3, a % -3)


def test_float_division_semantics():
    a = torch.tensor([7.5, -7.5, 1.0, -1.0, 0.0, 5.0, float("nan")])
    b = torch.tensor([2.0, 2.0, 0.0, 0.0, -3.0, -0.0, 1.0])
    for mode in (None, "trunc", "floor"):
        _same(torch.div(tpu(a), tpu(b), rounding_mode=mode), torch.div(a, b, rounding_mode=mode))
    _same(torch.remainder(tpu(a), tpu(b)), torch.remainder(a, b))
    _same(torch.fmod(tpu(a), tpu(b)), torch.fmod(a, b))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        torch.remainder,
        torch.fmod,
        torch.floor_divide,
    ],
)
def test_int_division_by_zero_raises_at_the_op_as_cpu(fn):
    # CPU raises at the op and CUDA checks nothing, so the check is not deferred
    # (Note [Device-side checks]): CPU's exception and text, at the op.
    a, b = torch.tensor([5, -5]), torch.tensor([1, 0])
    with pytest.raises(RuntimeError) as cpu:
        fn(a, b)
    with pytest.raises(RuntimeError) as got:
        fn(tpu(a), tpu(b))
    assert str(got.value) == str(cpu.value)
    with pytest.raises(RuntimeError) as cpu:
        fn(a, 0)
    with pytest.raises(RuntimeError) as got:
        fn(tpu(a), 0)
    assert str(got.value) == str(cpu.value)


def test_zero_divisor_check_reads_only_a_tpu_divisor():
    # A Python number or CPU tensor divisor is read on the host; a tpu tensor's check is
    # one device read at the op (CPU raises there; CUDA would not check at all).
    x = tpu(torch.tensor([4, 6]))
    torch.tpu.synchronize()
    torchjax.reset_stats()
    x // 7, x % 3, torch.fmod(x, torch.tensor(5)), torch.div(x, 2, rounding_mode="trunc")
    assert torchjax.stats()["host_reads"] == 0
    x // tpu(torch.tensor([1, 2]))
    assert torchjax.stats()["host_reads"] == 1
    x.float() // tpu(torch.tensor([0.0, 2.0]))  # a float result: no check
    assert torchjax.stats()["host_reads"] == 1


def test_nan_propagation():
    x = torch.tensor([float("nan"), 1.0, 3.0, -1.0])
    y = torch.tensor([0.0, float("nan"), 2.0, 5.0])
    for fn in (torch.maximum, torch.minimum, torch.fmax, torch.fmin):
        _same(fn(tpu(x), tpu(y)), fn(x, y))
    _same(torch.clamp(tpu(x), 0.0, 2.0), torch.clamp(x, 0.0, 2.0))
    _same(torch.clamp(tpu(x), min=float("nan")), torch.clamp(x, min=float("nan")))
    _same(torch.clamp(tpu(x), tpu(y), None), torch.clamp(x, y, None))
    _same(torch.clamp(tpu(x), 2.0, 0.0), torch.clamp(x, 2.0, 0.0))


def test_promotion_with_scalars():
    i = torch.tensor([1, 2, 3])
    h = torch.tensor([1.0, 2.0], dtype=torch.float16)
    _same(tpu(i) + 1.5, i + 1.5)
    _same(tpu(i) * True, i * True)
    _same(tpu(h) * 2.5, h * 2.5)
    _same(torch.add(tpu(i), tpu(i), alpha=3), torch.add(i, i, alpha=3))
    _same(torch.clamp(tpu(i), min=1.5), torch.clamp(i, min=1.5))
    _same(torch.where(tpu(i) > 1, tpu(i), 0.5), torch.where(i > 1, i, 0.5))
    _same(tpu(i) == torch.tensor(2), i == torch.tensor(2))


def test_int64_past_2_31():
    a = torch.tensor([2**40, -(2**35) - 1, 2**62])
    _same(tpu(a) + 1, a + 1)
    _same(tpu(a) * 2, a * 2)
    _same(tpu(a) // 7, a // 7)
    _same(tpu(a) > 2**33, a > 2**33)


def test_bool_errors():
    with pytest.raises(NotImplementedError, match="aten::bitwise_and"):
        torch.bitwise_and(tpu(torch.tensor([1.0])), tpu(torch.tensor([1.0])))


_I, _F, _B, _C = (
    torch.tensor([1, 2]),
    torch.tensor([1.5, 2.0]),
    torch.tensor([True, False]),
    torch.tensor([1 + 1j, 2]),
)

# add/sub/rsub's own refusals (BinaryOps.cpp: sub_check, alpha_check, TensorIterator's
# cast to out=) and div's and clamp's argument checks: CPU's text, word for word.
_ARGUMENT_REFUSALS = {
    "add_int_float_alpha": lambda i, f, b, c: torch.add(i, i, alpha=0.5),
    "add_scalar_float_alpha": lambda i, f, b, c: torch.add(i, 2, alpha=0.5),
    "add_int_complex_alpha": lambda i, f, b, c: torch.add(i, i, alpha=1j),
    "add_float_complex_alpha": lambda i, f, b, c: torch.add(f, i, alpha=1j),
    "add_complex_bool_alpha": lambda i, f, b, c: torch.add(c, c, alpha=True),
    "add_int_bool_alpha": lambda i, f, b, c: torch.add(i, i, alpha=True),
    "add_out_float_alpha": lambda i, f, b, c: torch.add(i, i, alpha=0.5, out=f.clone()),
    "add_out_cast_before_alpha": lambda i, f, b, c: torch.add(f, i, alpha=0.5, out=i.clone()),
    "sub_int_float_alpha": lambda i, f, b, c: torch.sub(i, i, alpha=0.5),
    "sub_bool_float_alpha": lambda i, f, b, c: torch.sub(b, b, alpha=0.5),
    "rsub_int_complex_alpha": lambda i, f, b, c: torch.rsub(i, i, alpha=1j),
    "rsub_scalar_complex_alpha": lambda i, f, b, c: torch.rsub(f, 2, alpha=1j),
    "div_rounding_mode": lambda i, f, b, c: torch.div(b, b, rounding_mode="bad"),
    "clamp_no_bound": lambda i, f, b, c: torch.clamp(b),
    "clamp_complex_no_bound": lambda i, f, b, c: torch.clamp(c),
}


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", sorted(_ARGUMENT_REFUSALS))
def test_argument_refusals_are_cpus_word_for_word(name, mode):
    fn = _ARGUMENT_REFUSALS[name]
    with pytest.raises(RuntimeError) as cpu:
        fn(_I.clone(), _F.clone(), _B.clone(), _C.clone())
    args = [tpu(t) for t in (_I, _F, _B, _C)]
    with pytest.raises(RuntimeError) as got:
        (torchjax.jit(fn) if mode == "jit" else fn)(*args)
    assert str(got.value) == str(cpu.value)


_BOOL = torch.tensor([True, False])
_INT = torch.tensor([3, 4])

# Every spelling of a subtraction with a bool operand: CPU refuses each, though promotion
# would compute ``1.0 - mask`` in float.
_SUBTRACTIONS = {
    "tensor_minus_int": lambda b, i: b - 1,
    "tensor_minus_true": lambda b, i: b - True,
    "int_tensor_minus_true": lambda b, i: i - True,
    "true_minus_tensor": lambda b, i: True - b,
    "float_minus_tensor": lambda b, i: 1.0 - b,
    "true_minus_int_tensor": lambda b, i: True - i,
    "rsub_two_bools": lambda b, i: torch.rsub(b, b),
    "rsub_int_and_bool": lambda b, i: torch.rsub(i, b),
    "rsub_scalar_true": lambda b, i: torch.ops.aten.rsub.Scalar(i, True),
    "in_place": lambda b, i: b.clone().sub_(b),
    "int_in_place": lambda b, i: i.clone().sub_(b),
    "out": lambda b, i: torch.sub(i, b, out=torch.empty_like(i)),
}


@pytest.mark.parametrize("name", sorted(_SUBTRACTIONS))
def test_subtraction_with_a_bool_operand_raises_cpus_error(name):
    fn = _SUBTRACTIONS[name]
    with pytest.raises(RuntimeError) as cpu:
        fn(_BOOL, _INT)
    with pytest.raises(RuntimeError) as got:
        fn(tpu(_BOOL), tpu(_INT))
    assert str(got.value) == str(cpu.value)


def test_inplace_and_out():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = tpu(base)
    t[:, 1].add_(10)
    base[:, 1].add_(10)
    _same(t, base)
    t[1].div_(2, rounding_mode="floor")
    base[1].div_(2, rounding_mode="floor")
    _same(t, base)
    t[0].clamp_(min=3)
    base[0].clamp_(min=3)
    _same(t, base)
    out = torch.empty(0, device="tpu", dtype=torch.float64)
    torch.mul(tpu(base), 2, out=out)
    _same(out, base.double() * 2)
    iout = torch.empty(3, 4, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.add(tpu(base), 1, out=iout)
    with pytest.raises(RuntimeError):
        tpu(torch.tensor([1, 2])).add_(1.5)


def test_empty_and_zero_dim():
    e = torch.empty(0, 2)
    s = torch.tensor(3.0)
    _same(tpu(e) + tpu(e), e + e)
    _same(tpu(s) * tpu(s), s * s)
    _same(tpu(e) + tpu(s), e + s)
    _same(torch.where(tpu(s) > 1, tpu(e), 1.0), torch.where(s > 1, e, 1.0))


def test_complex_logaddexp_at_infinities_and_nan():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([inf, -inf, complex(inf, 1.0), 1 + 2j, complex(nan, 0), 3 - 1j])
    b = torch.tensor([1.0, 2.0, -inf, inf, 1.0, 3 + 2j], dtype=torch.cfloat)
    a = a.to(torch.cfloat)
    for x, y in ((a, a), (a, b), (b, a)):
        want = torch.logaddexp(x, y)
        got = torch.logaddexp(x.to("tpu"), y.to("tpu")).cpu()
        torch.testing.assert_close(got, want, equal_nan=True)


def test_promotion_follows_the_default_dtype():
    # The default dtype decides int / int and int * 0.5: a cached key must not keep the
    # dtype of the first call.
    a = torch.tensor([7, 3], dtype=torch.int16)
    b = a + 1
    before = torch.get_default_dtype()
    try:
        for dtype in (torch.float64, torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            for f in (lambda x, y: torch.div(x, y), lambda x, y: x * 0.5):
                want, got = f(a, b), f(a.to("tpu"), b.to("tpu"))
                assert got.dtype == want.dtype == dtype
                torch.testing.assert_close(got.cpu(), want)
    finally:
        torch.set_default_dtype(before)


# A Python number, a 0-d tensor or an integer tensor meets a half-precision tensor:
# torch rounds it to the half type before computing in float32, except the second
# operand of mul / true div / floor_divide, read unrounded (Note [Half-precision inputs
# are rounded first]). 0.3, 0.1, 1.1, 2.3 are not representable in either half type.
_HALF_SCALAR_OPS = {
    "add": lambda a, s: a + s,
    "radd": lambda a, s: s + a,
    "sub": lambda a, s: a - s,
    "rsub": lambda a, s: s - a,
    "add_": lambda a, s: a.clone().add_(s),
    "mul": lambda a, s: a * s,
    "div": lambda a, s: a / s,
    "rdiv": lambda a, s: s / a,
    "floor_divide": lambda a, s: a // s,
    "remainder": lambda a, s: a % s,
    "fmod": lambda a, s: torch.fmod(a, s),
    "pow": lambda a, s: a.abs() ** s,
    "rpow": lambda a, s: abs(s) ** a,
    "atan2": lambda a, s: torch.atan2(a, torch.tensor(s)),
    "eq": lambda a, s: a == s,
    "ne": lambda a, s: a != s,
    "lt": lambda a, s: a < s,
    "ge": lambda a, s: a >= s,
    "add_0d": lambda a, s: a + torch.tensor(s),
    "eq_0d_tpu": lambda a, s: a == torch.tensor(s, device=a.device),
    "add_int_tensor": lambda a, s: a + torch.full(a.shape, int(s * 1000) + 2049, device=a.device),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_HALF_SCALAR_OPS))
def test_half_tensor_with_scalar_rounds_as_on_cpu(name, dtype):
    fn = _HALF_SCALAR_OPS[name]
    values = [0.3, 0.1, 1.1, 2.3, -2.3, 3.7, 9.4, -5.35, 0.7, -0.9, 4.24, 1.0]
    a = torch.tensor(values, dtype=dtype)
    checked = 0
    for s in [0.3, 0.1, 1.1, 2.3, -2.3, 5.2399, -4.47, 8.68]:
        want = fn(a, s)
        got = fn(a.to("tpu"), s).cpu()
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{name} {s}")
        checked += 1
    assert checked == 8


@pytest.mark.parametrize(
    "divisor",
    [lambda x: 0.3, lambda x: torch.tensor(0.7), lambda x: x.norm(dim=-1, keepdim=True)],
    ids=["python", "0-d", "keepdim-norm"],
)
def test_division_by_a_broadcast_divisor_is_correctly_rounded(divisor):
    # Note [Division by a broadcast divisor]: XLA's reciprocal rewrite gave last-bit
    # differences in about a quarter of the elements.
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 50
    d = divisor(x)
    want = x / d
    got = (x.to("tpu") / (d.to("tpu") if isinstance(d, torch.Tensor) else d)).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [torch.add, torch.sub])
def test_half_alpha_rounds_as_cpus_vector_loop(op, dtype):
    # 64 elements: CPU's vectorised loop covers all of them (Note [Half-precision inputs
    # are rounded first]).
    g = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(64, generator=g) * 5).to(dtype) for _ in range(2))
    checked = 0
    for alpha in [0.3, 8.682862832139197, -1.1, 2.3]:
        want = op(a, b, alpha=alpha)
        assert torch.equal(op(a.to("tpu"), b.to("tpu"), alpha=alpha).cpu(), want), alpha
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("op", [torch.add, torch.sub, torch.rsub, torch.Tensor.add_])
def test_float32_alpha_is_one_fma_as_cpu(op):
    # Note [A scaled add rounds once]: CPU's float32 kernels round self + alpha * other
    # once; the suite compiles at optimisation level 0, where XLA contracts nothing, so
    # this fails unless the lowering states the FMA. A Python-number other too, and an
    # alpha that changes every call (a value of the program).
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4096, generator=g) for _ in range(2))
    checked = 0
    for alpha in [0.1, -0.3, 2.5, 1e-3]:
        want = op(a.clone(), b, alpha=alpha)
        assert torch.equal(op(a.to("tpu"), b.to("tpu"), alpha=alpha).cpu(), want), alpha
        if op is not torch.Tensor.add_:
            assert torch.equal(op(a.to("tpu"), 0.7, alpha=alpha).cpu(), op(a, 0.7, alpha=alpha))
        checked += 1
    assert checked == 4


_INT_VALUES = {
    torch.uint8: [0, 1, 6, 128, 255],
    torch.int8: [-128, -127, -5, -1, 0, 1, 2, 5, 6, 127],
    torch.int16: [-32768, -6, -1, 0, 4, 9, 32767],
    # Not the minimum with -1: CPU's remainder traps there (SIGFPE).
    torch.int32: [-2147483647, -12, -2, 0, 3, 18, 2**31 - 1],
    torch.int64: [-(2**62), -10, 0, 7, 2**62, 2**63 - 1],
}


def _all_pairs(dtype, left, right):
    pairs = [(a, b) for a in left for b in right]
    return (
        torch.tensor([a for a, _ in pairs], dtype=dtype),
        torch.tensor([b for _, b in pairs], dtype=dtype),
    )


@pytest.mark.parametrize("dtype", list(_INT_VALUES), ids=str)
@pytest.mark.parametrize("op", [torch.gcd, torch.lcm], ids=["gcd", "lcm"])
def test_gcd_lcm_as_atens_kernel_at_the_extremes(op, dtype):
    # ATen's calc_gcd: |x| stored back in the type (the minimum stays negative), C's
    # remainder; lcm = |a / gcd * b| with the product wrapping.
    a, b = _all_pairs(dtype, _INT_VALUES[dtype], _INT_VALUES[dtype])
    assert torch.equal(op(a.to("tpu"), b.to("tpu")).cpu(), op(a, b))


def test_gcd_of_the_integer_minimum_ends():
    # jnp.gcd looped forever on it (abs of the minimum stays negative): in a child
    # process, so a hang fails the test instead of the suite.
    from tests._child import run_python

    result = run_python(
        """
        import torch, torchjax
        for dt in (torch.int8, torch.int32, torch.int64):
            low = torch.iinfo(dt).min
            a = torch.tensor([low, low, 5, low], dtype=dt, device="tpu")
            b = torch.tensor([3, 0, low, low], dtype=dt, device="tpu")
            print(torch.gcd(a, b).tolist(), torch.lcm(a, b).tolist())
        """,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[1, -128, -1, -128] [-128, 0, -128, -128]"
    assert lines[1] == f"[1, {-(2**31)}, -1, {-(2**31)}] [{-(2**31)}, 0, {-(2**31)}, {-(2**31)}]"


_BOOL_TIMES_NAN_CALLS = {
    "mul": lambda b, x: b * x,
    "mul_float": lambda b, x: b.float() * x,
    "mul_to": lambda b, x: x * b.to(x.dtype),
    "dot": lambda b, x: torch.dot(b.to(x.dtype), x),
}


@pytest.mark.parametrize("mode", ["eager", "fused", "jit"])
@pytest.mark.parametrize("name", sorted(_BOOL_TIMES_NAN_CALLS))
def test_false_times_inf_is_nan(name, mode):
    # XLA folds a product with a converted bool into a select (0 for False); IEEE and
    # CPU give NaN for False * inf.
    fn = _BOOL_TIMES_NAN_CALLS[name]
    mask = torch.tensor([True, False, False, True])
    x = torch.tensor([float("inf"), float("inf"), float("nan"), 2.0])
    want = fn(mask, x)
    args = (mask.to("tpu"), x.to("tpu"))
    if mode == "jit":
        got = torchjax.jit(fn)(*args)
    elif mode == "fused":
        with torchjax.fused():
            got = fn(*args)
    else:
        got = fn(*args)
    torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    assert want.isnan().any()


def _outcome(fn, x):
    try:
        fn(x)
    except RuntimeError as e:
        return type(e), str(e).split(" (in aten::")[0]
    return "ok"


_ALPHAS = [65519, 70000, 1e39, 2**40, 300, 2.5]


@pytest.mark.parametrize("op", [torch.add, torch.sub], ids=["add", "sub"])
@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int8, torch.uint8],
    ids=str,
)
def test_alpha_that_does_not_fit_the_result_type_raises_as_cpu(op, dtype):
    # CPU's kernels read alpha as the result type through c10's checked conversion.
    checked = 0
    for alpha in _ALPHAS:
        if isinstance(alpha, float) and not dtype.is_floating_point:
            continue  # a float alpha of an integer tensor: torch's own type error
        x = torch.ones(2, dtype=dtype)
        fn = lambda t, a=alpha: op(t, t, alpha=a)  # noqa: E731
        assert _outcome(fn, x.to("tpu")) == _outcome(fn, x), alpha
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_division_is_c10s_at_infinities_and_nans(dtype):
    # CPU divides complexes with c10's scaled division (Note [Complex special values]):
    # 1 / (inf + inf j) is NaN there (XLA: 0), (nan - inf j) / 2 is NaN + NaN j, and
    # _refs.sigmoid(-501 - 501j) = 1 / (1 + exp(501 + 501j)) is NaN.
    from tests.ops.test_complex_special_values import RTOL, _same

    inf, nan = float("inf"), float("nan")
    nums = [1, complex(1, 2), complex(inf, 1), complex(nan, -inf), complex(-0.0, 3), 2.5j]
    dens = [complex(inf, inf), complex(2, 0), complex(1.5, -2), complex(0, -0.0), -4j]
    a = torch.tensor([n for n in nums for _ in dens], dtype=dtype)
    b = torch.tensor([d for _ in nums for d in dens], dtype=dtype)
    want = (a.repeat_interleave(64) / b.repeat_interleave(64))[::64]  # CPU's vector lanes
    got = (a.to("tpu") / b.to("tpu")).cpu()
    assert _same(want, got, RTOL[dtype]).all(), (want, got)
    z = torch.tensor([complex(-501, -501)] * 64, dtype=dtype)
    got = torch._refs.sigmoid(z.to("tpu")).cpu()
    assert torch.equal(got.isnan(), torch._refs.sigmoid(z).isnan())


@pytest.mark.parametrize(
    "op", [torch.floor_divide, torch.remainder, torch.fmod], ids=lambda f: f.__name__
)
def test_bool_division_refused_by_dtype_before_the_zero_divisor_check(op):
    # A False divisor made the zero-divisor check answer first (RuntimeError
    # "ZeroDivisionError"); CPU has no bool kernel at all (NotImplementedError).
    a, b = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    with pytest.raises(NotImplementedError) as cpu:
        op(a, b)
    with pytest.raises(NotImplementedError, match=str(cpu.value).split(" not ")[0]):
        op(a.to("tpu"), b.to("tpu"))
    # An integer result still checks its divisor.
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        op(a.to("tpu").int(), b.to("tpu"))
