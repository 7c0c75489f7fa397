"""LAPACK-backed results have CPU's strides (Note [LAPACK's column-major results] in
torchjax/ops/linalg.py): column-major matrices, in batches, for the functional calls and
for out= tensors CPU resizes; values, views and aliasing as CPU's."""

import warnings

import pytest
import torch

import torchjax  # noqa: F401


def _general(shape):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _spd(shape):
    a = _general(shape)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=a.dtype)


# name -> (function of A, whether A must be square and positive definite, whether the
# values are unique: eigenvectors and singular vectors differ in sign between LAPACK
# builds, so only their layout is compared).
CASES = {
    "inv": (torch.linalg.inv, False, True),
    "inv_ex": (torch.linalg.inv_ex, False, True),
    "inverse": (torch.inverse, False, True),
    "qr": (torch.linalg.qr, False, False),
    "qr_complete": (lambda a: torch.linalg.qr(a, mode="complete"), False, False),
    "qr_r": (lambda a: torch.linalg.qr(a, mode="r"), False, False),
    "geqrf": (torch.geqrf, False, False),
    "householder_product": (
        lambda a: torch.linalg.householder_product(*torch.geqrf(a)),
        False,
        False,
    ),
    "ormqr": (lambda a: torch.ormqr(*torch.geqrf(a), a), False, False),
    "svd": (torch.linalg.svd, False, False),
    "svd_thin": (lambda a: torch.linalg.svd(a, full_matrices=False), False, False),
    "svd_legacy": (torch.svd, False, False),
    "eigh": (torch.linalg.eigh, True, False),
    "eig": (torch.linalg.eig, False, False),
    "cholesky": (torch.linalg.cholesky, True, True),
    "cholesky_upper": (lambda a: torch.linalg.cholesky(a, upper=True), True, True),
    "cholesky_legacy": (torch.cholesky, True, True),
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), True, True),
    "cholesky_solve": (lambda a: torch.cholesky_solve(a, torch.linalg.cholesky(a)), True, True),
    "lu": (torch.linalg.lu, False, True),
    "lu_factor": (torch.linalg.lu_factor, False, True),
    "lu_factor_ex": (torch.linalg.lu_factor_ex, False, True),
    "lu_solve": (lambda a: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), a), False, True),
    "solve": (lambda a: torch.linalg.solve(a, a.exp()), False, True),
    "solve_vector": (lambda a: torch.linalg.solve(a, a[..., 0]), False, True),
    "solve_right": (lambda a: torch.linalg.solve(a, a.exp(), left=False), False, True),
    "solve_ex": (lambda a: torch.linalg.solve_ex(a, a.exp()), False, True),
    "lstsq": (lambda a: torch.linalg.lstsq(a, a.exp()), False, True),
    "lstsq_gelsd": (lambda a: torch.linalg.lstsq(a, a.exp(), driver="gelsd"), False, True),
    "pinv": (torch.linalg.pinv, False, True),
    "det": (torch.linalg.det, False, True),
    "slogdet": (torch.linalg.slogdet, False, True),
    "matrix_exp": (torch.linalg.matrix_exp, False, True),
    "triangular_solve": (lambda a: torch.triangular_solve(a, a.triu()), False, True),
    "solve_triangular": (
        lambda a: torch.linalg.solve_triangular(a.triu(), a, upper=True),
        False,
        True,
    ),
    "solve_triangular_right": (
        lambda a: torch.linalg.solve_triangular(a.triu(), a, upper=True, left=False),
        False,
        True,
    ),
    "ldl_factor": (torch.linalg.ldl_factor, True, False),
    "ldl_solve": (lambda a: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), a), True, True),
}
SHAPES = [(4, 4), (3, 4, 4), (2, 1, 4, 4), (5, 3), (2, 3, 5)]


def _run(fn, a):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's deprecation notes
            return fn(a)
    except RuntimeError as error:
        return RuntimeError, str(error)


def _tensors(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, tuple) and result and result[0] is RuntimeError:
        return []
    return [t for t in result if isinstance(t, torch.Tensor)]


def _layout(t):
    return (
        tuple(t.shape),
        t.stride(),
        t.is_contiguous(),
        t.mT.is_contiguous() if t.dim() > 1 else None,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_results_have_cpus_strides(name, shape):
    fn, spd, unique = CASES[name]
    if spd and shape[-1] != shape[-2]:
        return  # no positive definite matrix of this shape: nothing to compare
    a = _spd(shape) if spd else _general(shape)
    cpu, tpu = _run(fn, a), _run(fn, a.to("tpu"))
    cpu_ts, tpu_ts = _tensors(cpu), _tensors(tpu)
    if not cpu_ts:
        # CPU refuses (a non-square matrix): the same exception type.
        assert not tpu_ts and tpu[0] is cpu[0]
        return
    assert [_layout(t) for t in tpu_ts] == [_layout(t) for t in cpu_ts]
    if unique:
        for t, c in zip(tpu_ts, cpu_ts):
            torch.testing.assert_close(t.cpu(), c)


def test_the_cases_cover_column_major_results():
    # Guard against a vacuous sweep: most cases give a non-contiguous result on CPU.
    fortran = 0
    for fn, spd, _ in CASES.values():
        a = _spd((3, 4, 4)) if spd else _general((3, 4, 4))
        fortran += any(t.dim() > 1 and not t.is_contiguous() for t in _tensors(_run(fn, a)))
    assert fortran >= 30


@pytest.mark.parametrize("shape", [(4, 4), (3, 4, 4)], ids=str)
def test_views_of_a_column_major_result_as_cpu(shape):
    a = _general(shape)
    results = {}
    for device in ("cpu", "tpu"):
        x = torch.linalg.inv(a.to(device))
        with pytest.raises(RuntimeError, match="view size is not compatible") as error:
            x.view(-1)
        seen = [str(error.value).split(" (in aten::")[0]]
        flat = x.mT.reshape(-1)
        assert flat._base is x  # a view: x.mT is contiguous
        seen.append(flat.cpu().clone())
        seen.append(x.contiguous().stride())
        seen.append((x * 2).stride())  # elementwise results follow the input's order
        # Writes through views reach the result, as on CPU.
        x.mT[..., 0, :].add_(1)
        x[..., 1, 2].mul_(3)
        seen.append(x.cpu())
        results[device] = seen
    cpu, tpu = results["cpu"], results["tpu"]
    assert tpu[0] == cpu[0] and tpu[2:4] == cpu[2:4]
    torch.testing.assert_close(tpu[1], cpu[1])
    torch.testing.assert_close(tpu[4], cpu[4])


def _empty(device, dtype=torch.float64):
    return torch.empty(0, dtype=dtype, device=device)


OUT_CASES = {
    "inv": lambda a, d: torch.linalg.inv(a, out=_empty(d)),
    "qr": lambda a, d: torch.linalg.qr(a, out=(_empty(d), _empty(d))),
    "svd": lambda a, d: torch.linalg.svd(a, out=(_empty(d), _empty(d), _empty(d))),
    "solve": lambda a, d: torch.linalg.solve(a, a, out=_empty(d)),
    "lu_factor": lambda a, d: torch.linalg.lu_factor(a, out=(_empty(d), _empty(d, torch.int32))),
    "cholesky_solve": lambda a, d: torch.cholesky_solve(a, a, out=_empty(d)),  # stays row-major
    "lstsq": lambda a, d: torch.linalg.lstsq(
        a[..., :3], a, out=(_empty(d), _empty(d), _empty(d, torch.int64), _empty(d))
    ),
    "inv_into_sized_out": lambda a, d: torch.linalg.inv(
        a, out=torch.empty(a.shape, dtype=a.dtype, device=d)
    ),
}


@pytest.mark.parametrize("name", sorted(OUT_CASES))
def test_resized_outs_take_cpus_strides(name):
    a = _general((3, 4, 4))
    layouts = {}
    for device in ("cpu", "tpu"):
        result = OUT_CASES[name](a.to(device), device)
        layouts[device] = [(_layout(t), t.cpu()) for t in _tensors(result)]
    assert [lay for lay, _ in layouts["tpu"]] == [lay for lay, _ in layouts["cpu"]]
    if name not in ("qr", "svd"):
        for (_, t), (_, c) in zip(layouts["tpu"], layouts["cpu"]):
            torch.testing.assert_close(t, c)
