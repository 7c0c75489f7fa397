"""Tests for torchjax/ops/linalg.py: OpInfo sweep over torch.linalg and the legacy linear
algebra functions, plus what OpInfo misses (errors, batching, float64, gradients)."""

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests
from torchjax.device import _checks
from torchjax.testing.opinfo import same

OPS = [
    "linalg.cholesky",
    "linalg.cholesky_ex",
    "linalg.cond",
    "linalg.cross",
    "linalg.det",
    "linalg.diagonal",
    "linalg.eig",
    "linalg.eigh",
    "linalg.eigvals",
    "linalg.eigvalsh",
    "linalg.inv",
    "linalg.inv_ex",
    "linalg.ldl_factor",
    "linalg.ldl_factor_ex",
    "linalg.ldl_solve",
    "linalg.lu",
    "linalg.lu_factor",
    "linalg.lu_factor_ex",
    "linalg.lu_solve",
    "linalg.matrix_norm",
    "linalg.matrix_power",
    "linalg.matrix_rank",
    "linalg.matrix_rank.hermitian",
    "linalg.multi_dot",
    "linalg.norm",
    "linalg.norm.subgradients_at_zero",
    "linalg.pinv",
    "linalg.pinv.hermitian",
    "linalg.pinv.singular",
    "linalg.slogdet",
    "linalg.solve",
    "linalg.solve_ex",
    "linalg.solve_triangular",
    "linalg.svd",
    "linalg.svdvals",
    "linalg.tensorinv",
    "linalg.tensorsolve",
    "linalg.vander",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "logdet",
    "lu",
    "lu_solve",
    "lu_unpack",
    "matrix_exp",
    "pinverse",
    "svd",
    "triangular_solve",
    "norm.nuc",
    "pca_lowrank",
    "svd_lowrank",
    "trace",
    "kron",
    "addr",
    "cross",
]
globals().update(make_tests(OPS))


def _tpu(*ts):
    return [t.to("tpu") for t in ts]


def _spd(n, *batch, dtype=torch.float64):
    a = torch.randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


def test_batched_broadcast_solves():
    a, b = torch.randn(2, 1, 3, 3, dtype=torch.float64), torch.randn(4, 3, 2, dtype=torch.float64)
    same(torch.linalg.solve, a, b)
    same(torch.linalg.solve, a, torch.randn(2, 4, 2, 3, dtype=torch.float64), left=False)
    same(torch.linalg.solve, torch.randn(3, 3), torch.randn(3))
    tri = torch.randn(2, 1, 3, 3, dtype=torch.float64).triu() + 3 * torch.eye(3)
    same(torch.linalg.solve_triangular, tri, b, upper=True)
    same(torch.cholesky_solve, b, torch.linalg.cholesky(_spd(3, 2, 1)))
    lu, piv = torch.linalg.lu_factor(a)
    same(torch.linalg.lu_solve, lu, piv, b, adjoint=True)


def test_inv_singular_raises_like_torch():
    a = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])
    with pytest.raises(torch.linalg.LinAlgError) as cpu:
        torch.linalg.inv(a)
    with pytest.raises(torch.linalg.LinAlgError, match="linalg.inv: The diagonal element") as got:
        torch.linalg.inv(a.to("tpu"))
    assert str(got.value) == str(cpu.value)
    batch = torch.stack([torch.eye(3), a])
    with pytest.raises(torch.linalg.LinAlgError, match=r"linalg.inv: \(Batch element 1\)"):
        torch.linalg.inv(batch.to("tpu"))
    inv, info = torch.linalg.inv_ex(batch.to("tpu"))
    assert info.cpu().tolist() == torch.linalg.inv_ex(batch).info.tolist()


def test_solve_singular_raises():
    a = torch.zeros(2, 2)
    with pytest.raises(torch.linalg.LinAlgError, match="linalg.solve: The solver failed"):
        torch.linalg.solve(a.to("tpu"), torch.ones(2).to("tpu"))


def test_shape_errors_are_torchs():
    a, b = _tpu(torch.randn(3, 3), torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="linalg.solve: Incompatible shapes"):
        torch.linalg.solve(a, b)
    with pytest.raises(RuntimeError, match="linalg.cholesky: A must be batches of square"):
        torch.linalg.cholesky(torch.randn(2, 3).to("tpu"))


def test_cholesky_not_positive_definite():
    a = _spd(4)
    a[2, 2] = -100.0
    with pytest.raises(torch.linalg.LinAlgError) as cpu:
        torch.linalg.cholesky(a)
    with pytest.raises(torch.linalg.LinAlgError, match="leading minor of order 3") as got:
        torch.linalg.cholesky(a.to("tpu"))
    assert str(got.value) == str(cpu.value)
    batch = torch.stack([_spd(4), a])
    _, info = torch.linalg.cholesky_ex(batch.to("tpu"), upper=True)
    assert info.cpu().tolist() == torch.linalg.cholesky_ex(batch, upper=True).info.tolist()


def test_lu_factor_info_and_unpack():
    a = torch.randn(2, 5, 3, dtype=torch.float64)
    a[1, :, 1] = 0
    same(torch.linalg.lu_factor_ex, a)
    same(torch.linalg.lu, a)
    same(torch.lu_unpack, *torch.linalg.lu_factor(a[:1]), unpack_data=False)


def test_float64_precision():
    a = torch.randn(6, 6, dtype=torch.float64)
    for fn in (torch.linalg.det, torch.linalg.inv, torch.linalg.svdvals, torch.linalg.eigvalsh):
        got = fn(a.to("tpu"))
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.cpu(), fn(a), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("fn", ["det", "inv", "solve", "slogdet"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_gradients_vs_cpu(fn, contiguous):
    # Non-contiguous A takes ATen's other LU path (Note [LU of the transpose]).
    a = torch.randn(2, 4, 4, dtype=torch.float64)
    a = a if contiguous else a.mT
    b = torch.randn(2, 4, 3, dtype=torch.float64)

    def loss(a, b):
        if fn == "solve":
            return torch.linalg.solve(a, b).sum()
        if fn == "slogdet":
            return torch.linalg.slogdet(a).logabsdet.sum()
        return (getattr(torch.linalg, fn)(a) ** 2).sum()

    grads = []
    for dev in ("cpu", "tpu"):
        ta = a.detach().to(dev)
        ta = (ta if contiguous else ta.mT.contiguous().mT).requires_grad_()
        tb = b.to(dev).requires_grad_()
        grads.append(
            [
                g.cpu()
                for g in torch.autograd.grad(loss(ta, tb), (ta, tb), allow_unused=True)
                if g is not None
            ]
        )
    for g, c in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, c)


def test_eigh_up_to_sign():
    # Eigenvector signs are implementation-defined (LAPACK builds differ); torch's OpInfo
    # compares abs(eigenvectors), as done here, and gradients of sign-invariant losses.
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    a = a + a.mT
    w, v = torch.linalg.eigh(a)
    tw, tv = torch.linalg.eigh(a.to("tpu"), UPLO="L")
    torch.testing.assert_close(tw.cpu(), w)
    torch.testing.assert_close(tv.cpu().abs(), v.abs())
    at = a.to("tpu").requires_grad_()
    ac = a.clone().requires_grad_()
    for x in (at, ac):
        ww, vv = torch.linalg.eigh(x)
        (ww.sum() + (vv.abs() * torch.arange(5.0, dtype=x.dtype, device=x.device)).sum()).backward()
    torch.testing.assert_close(at.grad.cpu(), ac.grad)


def test_empty_matrices():
    for fn in (torch.linalg.det, torch.linalg.inv, torch.linalg.cholesky, torch.linalg.svdvals):
        same(fn, torch.zeros(2, 0, 0))
    same(torch.linalg.pinv, torch.zeros(0, 3))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"hermitian": True}, {"atol": 0.5}, {"atol": 0.5, "rtol": 0.1}, {"tol": 0.5}],
    ids=["default", "hermitian", "atol", "atol_rtol", "tol"],
)
def test_matrix_rank_out_is_written(kwargs):
    # Note [matrix_rank out=]: ATen's composite out= kernel left a subclass's out as it was.
    a = torch.randn(3, 4, 4, dtype=torch.float64)
    a[0, :, 0] = 0  # rank 3
    if kwargs.get("hermitian"):
        a = a + a.mT
    expected = torch.linalg.matrix_rank(a, **kwargs)
    out = torch.full((3,), 7, dtype=torch.long, device="tpu")
    result = torch.linalg.matrix_rank(a.to("tpu"), **kwargs, out=out)
    assert result is out
    torch.testing.assert_close(out.cpu(), expected)


def test_matrix_rank_out_tensor_tolerances():
    a = torch.randn(2, 3, 3)
    atol, rtol = torch.tensor(0.5), torch.tensor(0.1)
    expected = torch.linalg.matrix_rank(a, atol=atol, rtol=rtol)
    out = torch.empty(0, dtype=torch.long, device="tpu")
    torch.linalg.matrix_rank(a.to("tpu"), atol=atol.to("tpu"), rtol=rtol.to("tpu"), out=out)
    torch.testing.assert_close(out.cpu(), expected)


# ---------------------------------------------------------------------------------------
# LAPACK info errors: raised at the op in eager and by a compiled call, as CPU raises them


def _ones(a, *shape):
    return torch.ones(*shape, dtype=a.dtype, device=a.device)


_SINGULAR = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])
_SINGULAR_BATCH = torch.stack([torch.eye(3), _SINGULAR])  # batch element 1 fails
_NOT_PD = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # minor of order 2
_NOT_PD_BATCH = torch.stack([torch.eye(3), -torch.eye(3), _NOT_PD])
_ZERO_DIAGONAL = torch.stack([torch.eye(3), torch.diag(torch.tensor([1.0, 0.0, 1.0]))])
_NAN_BATCH = torch.stack([torch.eye(3), torch.eye(3).index_fill(1, torch.tensor([2]), torch.nan)])

# (id, function, input CPU refuses)
_FAILING = [
    ("inv", torch.linalg.inv, _SINGULAR),
    ("inv_batched", torch.linalg.inv, _SINGULAR_BATCH),
    ("inverse", torch.inverse, _SINGULAR_BATCH),
    ("inv_ex", lambda a: torch.linalg.inv_ex(a, check_errors=True).inverse, _SINGULAR_BATCH),
    ("matrix_power", lambda a: torch.linalg.matrix_power(a, -1), _SINGULAR),
    ("tensorinv", lambda a: torch.linalg.tensorinv(a, 1), _SINGULAR),
    ("solve", lambda a: torch.linalg.solve(a, _ones(a, 2, 3)), _SINGULAR_BATCH),
    ("solve_ex", lambda a: torch.linalg.solve_ex(a, _ones(a, 3), check_errors=True)[0], _SINGULAR),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a).LU, _SINGULAR_BATCH),
    ("lu_factor_ex", lambda a: torch.linalg.lu_factor_ex(a, check_errors=True).LU, _SINGULAR),
    ("cholesky", torch.linalg.cholesky, _NOT_PD),
    ("cholesky_upper_batched", lambda a: torch.linalg.cholesky(a, upper=True), _NOT_PD_BATCH),
    ("cholesky_legacy", torch.cholesky, _NOT_PD_BATCH),
    ("cholesky_ex", lambda a: torch.linalg.cholesky_ex(a, check_errors=True).L, _NOT_PD_BATCH),
    ("cholesky_inverse", torch.cholesky_inverse, _ZERO_DIAGONAL),
    ("cholesky_inverse_upper", lambda a: torch.cholesky_inverse(a, upper=True), _ZERO_DIAGONAL[1]),
    ("svd", lambda a: torch.linalg.svd(a).S, _NAN_BATCH),
    ("svdvals", torch.linalg.svdvals, _NAN_BATCH[1]),
    ("svd_legacy", lambda a: torch.svd(a).S, _NAN_BATCH),
    ("pinv", torch.linalg.pinv, _NAN_BATCH),
    ("matrix_rank", torch.linalg.matrix_rank, _NAN_BATCH[1]),
]

_MODES = {
    "eager": lambda fn: fn,
    "jit": torchjax.jit,
    "compile": lambda fn: torch.compile(fn, backend="tpu"),
}


@pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated")
@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("case", _FAILING, ids=[c[0] for c in _FAILING])
def test_linalg_errors_are_cpus_in_eager_and_compiled(case, mode):
    # CPU (eager and inductor) reads LAPACK's info back at the op and raises; eager tpu
    # raises there, a compiled call when it returns, never a result of NaN or inf.
    _, fn, bad = case
    with pytest.raises(RuntimeError) as cpu:
        fn(bad)
    run = _MODES[mode](fn)
    with pytest.raises(RuntimeError) as got:
        run(bad.to("tpu"))
    assert type(got.value) is type(cpu.value)
    assert str(got.value) == str(cpu.value)
    assert _checks.pending() == 0
    good = _spd(3, *bad.shape[:-2], dtype=bad.dtype)
    torch.testing.assert_close(run(good.to("tpu")).cpu(), fn(good))


# (id, function, input): inputs CPU answers without an error (NaN or inf in the result).
_NOT_FAILING = [
    (
        "triangular_solve",
        lambda a: torch.linalg.solve_triangular(a, _ones(a, 3, 1), upper=True),
        _SINGULAR,
    ),
    ("cholesky_solve", lambda a: torch.cholesky_solve(_ones(a, 3, 1), a), _ZERO_DIAGONAL),
    ("inv_ex", lambda a: torch.linalg.inv_ex(a).info, _SINGULAR_BATCH),
    ("cholesky_ex", lambda a: torch.linalg.cholesky_ex(a).info, _NOT_PD_BATCH),
    ("lu_factor_ex", lambda a: torch.linalg.lu_factor_ex(a).info, _SINGULAR_BATCH),
    ("svd_of_inf", torch.linalg.svdvals, torch.full((2, 2), torch.inf)),
    # (CPU raises for 3 x 3 and larger, with syevd's count of unconverged elements)
    ("eigvalsh_of_nan", torch.linalg.eigvalsh, torch.full((2, 2, 2), torch.nan)),
    ("pinv_hermitian_of_nan", lambda a: torch.linalg.pinv(a, hermitian=True), _NAN_BATCH),
    ("det", torch.linalg.det, _SINGULAR_BATCH),
]


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("case", _NOT_FAILING, ids=[c[0] for c in _NOT_FAILING])
def test_linalg_without_cpu_errors_does_not_raise(case, mode):
    _, fn, a = case
    got = _MODES[mode](fn)(a.to("tpu"))
    torch.testing.assert_close(got.cpu(), fn(a), equal_nan=True)
    assert _checks.pending() == 0


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_cholesky_info_is_the_first_failing_minor(mode):
    # potrf's info under tracing too: every position of the failing pivot, in a batch.
    fn = _MODES[mode](lambda a: torch.linalg.cholesky_ex(a).info)
    checked = 0
    for n in (1, 2, 5, 8, 17, 33):
        a = torch.eye(n, dtype=torch.float64).repeat(n + 1, 1, 1)
        a[torch.arange(n), torch.arange(n), torch.arange(n)] = -1.0
        r = torch.randn(4, n, n, dtype=torch.float64)
        for x in (a, r + r.mT + 2 * torch.eye(n, dtype=torch.float64)):
            assert fn(x.to("tpu")).cpu().tolist() == torch.linalg.cholesky_ex(x).info.tolist()
            checked += 1
    assert checked == 12
