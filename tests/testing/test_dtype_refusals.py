"""Tests for torchjax/testing/dtype_refusals.py: the survey that writes the table of dtypes
CPU torch refuses, on a few op_db entries, and the committed table against it."""

from __future__ import annotations

import json

import pytest

import torchjax  # noqa: F401
from torchjax.testing import dtype_refusals as survey

SURVEYED = [
    "softmax",
    "div.trunc_rounding",
    "kthvalue",
    "sort",
    "abs",
    "bucketize",
    "hypot",
    "remainder",
]


@pytest.fixture(scope="module")
def table():
    return survey.build_table(survey.survey(SURVEYED))


def test_kernel_refusals_are_entries(table):
    refused = table["refused"]
    (softmax,) = refused["_softmax.default"]
    assert softmax["args"] == ["self"] and softmax["error"] == "NotImplementedError"
    assert softmax["message"] == "\"softmax_lastdim_kernel_impl\" not implemented for '{type}'"
    assert {"bool", "int64", "complex64"} <= set(softmax["samples"])
    assert not {"float32", "float16", "bfloat16"} & set(softmax["samples"])


def test_a_deciding_argument_is_recorded(table):
    (trunc,) = table["refused"]["div.Tensor_mode"]
    assert trunc["when"] == {"rounding_mode": "trunc"}
    assert trunc["args"] == ["other", "self"]


def test_refusals_of_the_promoted_dtype_are_common(table):
    """hypot of int8 and int16 refuses 'Short': the entry reads the arguments' promoted
    dtype; softmax's one argument, and bool alone, cannot tell."""
    (hypot,) = table["refused"]["hypot.default"]
    assert hypot["common"] is True and hypot["args"] == ["other", "self"]
    assert "int16" in hypot["samples"]
    (softmax,) = table["refused"]["_softmax.default"]
    assert "common" not in softmax


def test_python_number_forms_are_surveyed(table):
    """``t % True`` reaches remainder.Scalar, ``True % t`` remainder.Scalar_Tensor, and
    ``t % u`` the same kernel: bool refused in each, a number counted as an argument."""
    refused = table["refused"]
    for key, form in [
        ("remainder.Scalar", "number_other"),
        ("remainder.Scalar_Tensor", "number_self"),
    ]:
        (entry,) = refused[key]
        assert entry["args"] == ["other", "self"]
        assert entry["message"] == "\"remainder_cpu\" not implemented for '{type}'"
        assert entry["samples"]["bool"][-1] == form


def test_shapes_cpu_answers_pass(table):
    (kthvalue,) = table["refused"]["kthvalue.default"]
    assert kthvalue["passes"] == ["0-dim"]


def test_samples_cast_where_the_generator_makes_none(table):
    """bucketize's generator sorts its boundaries, which CPU refuses for complex."""
    (bucketize,) = table["refused"]["bucketize.Tensor"]
    assert bucketize["samples"]["complex64"][3:] == ["float32"]


def test_cuda_accepted_dtypes_are_excluded(table):
    excluded = table["excluded"]
    assert "CUDA accepts" in excluded["sort.default"]["complex64"]
    assert "CUDA accepts" in excluded["abs.default"]["bool"]
    assert "abs.default" not in table["refused"]


def test_committed_table_agrees_with_the_survey(table):
    """Every refusal these entries show is in the committed file, as surveyed."""
    committed_table = json.loads(survey.DATA_FILE.read_text())
    assert survey.dumps(committed_table) == survey.DATA_FILE.read_text()
    for key, entries in table["refused"].items():
        committed = {
            (d, e["error"], e["message"], json.dumps(e.get("when", {})))
            for e in committed_table["refused"][key]
            for d in e["samples"]
        }
        for e in entries:
            for dtype in e["samples"]:
                row = (dtype, e["error"], e["message"], json.dumps(e.get("when", {})))
                assert row in committed, (key, row)


def test_dumps_is_json_one_line_per_entry(table):
    text = survey.dumps(table)
    assert json.loads(text) == json.loads(json.dumps(table))
    line = next(x for x in text.splitlines() if "softmax_lastdim_kernel_impl" in x)
    assert json.loads(line.strip().rstrip(","))["args"] == ["self"]
