"""Builds the OpInfo tests for a family of ops (used by tests/ops/test_*.py).

``make_tests(names)`` returns pytest test functions parametrized over every OpInfo entry
named in ``names`` and each of its CPU-supported dtypes among ``DTYPES``: forward,
backward (float32/float64 when the op supports autograd), in-place and ``out=``. Random
ops are checked by ``torchjax.testing.opinfo.check_random`` (Note [Random OpInfo samples]).
Cases listed in tests/ops/expected_failures.csv are strict xfails: a listed case that
starts passing fails the suite until its line is removed.
"""

from __future__ import annotations

import csv
import pathlib

import pytest
import torch

from torchjax.testing import opinfo as oi

_XFAIL_FILE = pathlib.Path(__file__).with_name("expected_failures.csv")
_SAMPLE_LIMIT = 8


def _load_xfails() -> dict[tuple[str, str, str], str]:
    rows = {}
    with open(_XFAIL_FILE, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            rows[(row["op"], row["dtype"], row["check"])] = row["reason"]
    return rows


XFAILS = _load_xfails()
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in oi.DTYPES}


def _cases(names, check):
    cases = []
    for op in oi.opinfos(names):
        supported = op.supported_dtypes("cpu")
        for dtype in oi.DTYPES:
            if dtype not in supported:
                continue
            if check == "backward" and (
                not op.supports_autograd or dtype not in (torch.float32, torch.float64)
            ):
                continue
            if check == "inplace" and op.get_inplace() is None:
                continue
            if check == "out" and not op.supports_out:
                continue
            key = (oi.full_name(op), _DTYPE_NAMES[dtype], check)
            marks = []
            if key in XFAILS:
                marks.append(pytest.mark.xfail(reason=XFAILS[key], strict=True))
            cases.append(pytest.param(op, dtype, id=f"{key[0]}-{key[1]}", marks=marks))
    return cases


def _make_test(check, cases):
    grad = check == "backward"

    @pytest.mark.parametrize("op,dtype", cases)
    def test(op, dtype):
        samples = oi.samples(op, dtype, requires_grad=grad, limit=_SAMPLE_LIMIT)
        ran = [oi.run_check(check, op, s) for s in samples]
        if grad:
            assert any(ran), "no sample had a differentiable output"

    return test


def make_tests(names):
    """Test functions for the checks that have at least one case (an empty parametrize
    would report a skip, and nothing here is skipped)."""
    names = list(names)
    tests = {}
    for check in ("forward", "backward", "inplace", "out"):
        cases = _cases(names, check)
        if cases:
            tests[f"test_opinfo_{check}"] = _make_test(check, cases)
    return tests
