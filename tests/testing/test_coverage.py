"""Tests for torchjax/testing/coverage.py: the OpInfo coverage script on a small --ops run."""

from __future__ import annotations

import io

import pytest

import torchjax  # noqa: F401
from torchjax.testing import coverage


def test_classify_causes():
    missing = NotImplementedError("torchjax has no lowering for aten::foo.default, called with")
    assert coverage.classify(missing) == (coverage.MISSING, "aten::foo.default")
    assert coverage.classify(AssertionError("x forward: dtype torch.int32, CPU gave torch.int64"))[
        0
    ] == (coverage.DTYPE)
    assert coverage.classify(AssertionError("x forward: Tensor-likes are not close!"))[0] == (
        coverage.VALUE
    )
    assert coverage.classify(AssertionError("x in-place: CPU raised E, tpu did not"))[0] == (
        coverage.ERROR
    )
    assert coverage.classify(RuntimeError("aten::add: shapes"))[0] == coverage.ERROR
    assert coverage.classify(KeyError("k"))[0] == coverage.CRASH


def test_small_run_prints_pass_rates_and_failures(capsys):
    assert coverage.main(["--ops", "atan2", "--limit", "1", "--dtypes", "float32,int64"]) == 0
    text = capsys.readouterr().out
    assert "1 op_db entries" in text
    assert "forward" in text and "1 /    1  (100.0%)" in text
    assert "backward (differentiable ops)" in text
    assert "float32" in text and "int64" in text


def test_failures_grouped_and_marked_listed_or_unlisted():
    results = [
        coverage.Result("a", "float32", "forward", None),
        coverage.Result("a", "int64", "forward", coverage.MISSING, "aten::x.default"),
        coverage.Result("b", "float32", "forward", coverage.VALUE, "b forward: not close"),
        coverage.Result("b", "float32", "backward", None),
        coverage.Result("c", "float32", "forward", None),
    ]
    xfails = {("a", "int64", "forward"): "no lowering", ("c", "float32", "forward"): "old"}
    out = io.StringIO()
    figures = coverage.summarize(results, xfails, out=out)
    text = out.getvalue()
    assert figures["forward"] == (1, 3) and figures["backward"] == (1, 1)
    assert "missing lowering: 1 cases (1 listed, 0 unlisted)" in text
    assert "aten::x.default: a int64/forward" in text
    assert "value mismatch: 1 cases (0 listed, 1 unlisted)" in text
    assert "c,float32,forward" in text  # listed but passing: a stale line
    lines = coverage.xfail_lines(results, xfails)
    assert lines == ['b,float32,forward,"value mismatch: b forward: not close"']


@pytest.mark.parametrize("name", ["bernoulli"])
def test_random_op_goes_through_check_random(name):
    results = coverage.run_op(name, ("float32",), 2, ("forward",), timeout=300)
    assert [r.cause for r in results] == [None]


def test_from_suite_reports_the_suites_cases_and_listed_failures():
    xfails = {("chalf", "float32", "forward"): "complex32 has no jax dtype"}
    results = coverage.suite_results(xfails)
    by_key = {(r.op, r.dtype, r.check): r for r in results}
    assert by_key[("chalf", "float32", "forward")].cause == coverage.LISTED
    assert by_key[("add", "float32", "forward")].cause is None
    assert ("add", "float32", "backward") in by_key  # differentiable: backward in float32
    assert ("add", "int64", "backward") not in by_key
    assert not any(r.op.startswith("jiterator_") for r in results)  # no CPU reference
    out = io.StringIO()
    figures = coverage.summarize(results, xfails, out=out)
    tested = len({r.op for r in results if r.check == "forward"})
    assert figures["forward"] == (tested - 1, tested)
    assert "chalf: float32/forward" in out.getvalue()
