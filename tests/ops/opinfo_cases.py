"""Builds the OpInfo tests for a family of ops (used by tests/ops/test_*.py).

``make_tests(names)`` returns pytest test functions parametrized over every OpInfo entry
named in ``names`` and each of its CPU-supported dtypes among ``DTYPES``: forward,
backward (float32/float64 when the op supports autograd), in-place and ``out=``.
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


def make_tests(names):
    """Test functions for the checks that have at least one case (an empty parametrize
    would report a skip, and nothing here is skipped)."""
    names = list(names)
    cases = {check: _cases(names, check) for check in ("forward", "backward", "inplace", "out")}
    tests = {}

    if cases["forward"]:

        @pytest.mark.parametrize("op,dtype", cases["forward"])
        def test_forward(op, dtype):
            for s in oi.samples(op, dtype, limit=_SAMPLE_LIMIT):
                oi.check_forward(op, s)

        tests["test_opinfo_forward"] = test_forward

    if cases["backward"]:

        @pytest.mark.parametrize("op,dtype", cases["backward"])
        def test_backward(op, dtype):
            ran = [
                oi.check_backward(op, s)
                for s in oi.samples(op, dtype, requires_grad=True, limit=_SAMPLE_LIMIT)
            ]
            assert any(ran), "no sample had a differentiable output"

        tests["test_opinfo_backward"] = test_backward

    if cases["inplace"]:

        @pytest.mark.parametrize("op,dtype", cases["inplace"])
        def test_inplace(op, dtype):
            for s in oi.samples(op, dtype, limit=_SAMPLE_LIMIT):
                oi.check_inplace(op, s)

        tests["test_opinfo_inplace"] = test_inplace

    if cases["out"]:

        @pytest.mark.parametrize("op,dtype", cases["out"])
        def test_out(op, dtype):
            for s in oi.samples(op, dtype, limit=_SAMPLE_LIMIT):
                oi.check_out(op, s)

        tests["test_opinfo_out"] = test_out

    return tests
