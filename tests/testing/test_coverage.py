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


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.ops.test_opinfo" name="test_opinfo_forward[add-float32]"/>
<testcase classname="tests.ops.test_opinfo" name="test_opinfo_forward[chalf-float32]">
  <skipped type="pytest.xfail" message="complex32 has no jax dtype"/></testcase>
<testcase classname="tests.ops.test_opinfo" name="test_opinfo_out[nn.functional.relu-int64]">
  <failure message="AssertionError: relu out=: dtype torch.int32, CPU gave torch.int64">tb</failure>
</testcase>
<testcase classname="tests.ops.test_opinfo" name="test_opinfo_backward[add-float32]"/>
<testcase classname="tests.ops.test_view_ops" name="test_view_dtype_aliases"/>
</testsuite></testsuites>
"""


def test_from_suite_counts_a_junit_run(tmp_path):
    path = tmp_path / "run.xml"
    path.write_text(_JUNIT)
    cases, totals = coverage.junit_outcomes([path])
    assert totals == {"passed": 3, "xfailed": 1, "failed": 1}
    assert cases[("add", "float32", "forward")] == (None, "")
    assert cases[("chalf", "float32", "forward")][0] == coverage.LISTED
    cause, detail = cases[("nn.functional.relu", "int64", "out")]
    assert cause == coverage.FAILED and "CPU gave torch.int64" in detail
    out = io.StringIO()
    results = coverage.suite_results([path], out=out)
    figures = coverage.summarize(results, {}, out=out)
    assert figures["forward"] == (1, 2) and figures["backward"] == (1, 1)
    assert figures["out"] == (0, 1)
    text = out.getvalue()
    assert "OpInfo cases in the run: 4; suite cases not in it:" in text
    assert "failed in the run: 1 cases" in text


def test_from_suite_main_reads_junit(tmp_path, capsys):
    path = tmp_path / "run.xml"
    path.write_text(_JUNIT)
    assert coverage.main(["--from-suite", str(path)]) == 0
    text = capsys.readouterr().out
    assert "counted from a test-suite run (run.xml)" in text
    assert "test cases in the run: 3 passed, 1 failed, 0 error, 1 xfailed" in text
