"""Calls the linalg ops refuse raise CPU's exception type and text, not the Python meta
kernels' (Note [Linalg refusals in CPU's words] in torchjax/ops/linalg.py)."""

import pytest
import torch

import torchjax  # noqa: F401

INPUTS = {
    "vector": lambda d: torch.randn(4, device=d),
    "int64": lambda d: torch.ones(3, 3, dtype=torch.int64, device=d),
    "float16": lambda d: torch.ones(3, 3, dtype=torch.float16, device=d),
    "wide": lambda d: torch.randn(3, 4, device=d),
}
OPS = {
    "inv": torch.linalg.inv,
    "inv_ex": torch.linalg.inv_ex,
    "inverse": torch.inverse,
    "cholesky": torch.linalg.cholesky,
    "qr": torch.linalg.qr,
    "svd": torch.linalg.svd,
    "eigh": torch.linalg.eigh,
    "eig": torch.linalg.eig,
    "solve": lambda a: torch.linalg.solve(a, a),
    "lu_factor": torch.linalg.lu_factor,
    "det": torch.linalg.det,
    "geqrf": torch.geqrf,
    "lstsq": lambda a: torch.linalg.lstsq(a, a),
    "matrix_exp": torch.linalg.matrix_exp,
    "cholesky_inverse": torch.cholesky_inverse,
    "solve_triangular": lambda a: torch.linalg.solve_triangular(a, a, upper=True),
    "ldl_factor": torch.linalg.ldl_factor,
}


def _answer(fn, device, make):
    try:
        fn(make(device))
    except Exception as error:  # noqa: BLE001 - compared with CPU's below
        return type(error), str(error).split(" (in aten::")[0]
    return None


@pytest.mark.parametrize("inp", sorted(INPUTS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_refusal_is_cpus(name, inp):
    cpu = _answer(OPS[name], "cpu", INPUTS[inp])
    assert _answer(OPS[name], "tpu", INPUTS[inp]) == cpu


def test_the_sample_holds_refusals_the_meta_kernels_word_otherwise():
    # Guard against a vacuous sweep: the meta kernel of linalg_inv_ex raises an
    # AssertionError naming "linalg.inv_ex" for a vector, CPU a RuntimeError.
    with pytest.raises(AssertionError):
        torch.ops.aten.linalg_inv_ex(torch.empty(4, device="meta"))
    refused = sum(
        _answer(fn, "cpu", make) is not None for fn in OPS.values() for make in INPUTS.values()
    )
    assert refused >= 50
    with pytest.raises(RuntimeError, match=r"^linalg.inv: The input tensor A must have at"):
        torch.linalg.inv(torch.randn(4, device="tpu"))
