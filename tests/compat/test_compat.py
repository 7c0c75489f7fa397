"""Every private upstream API torchjax uses, exercised directly (style.md: one place)."""

import torch

import torchjax  # noqa: F401
from torchjax._compat import torch as ct


def test_backend_name():
    assert ct.privateuse1_backend_name() == "tpu"


def test_elementwise_dtypes_kinds():
    a = torch.ones(2, dtype=torch.int64)
    assert ct.elementwise_dtypes(
        a, 1.5, type_promotion_kind=ct.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    ) == (torch.float32, torch.float32)
    h = torch.ones(2, dtype=torch.float16)
    assert ct.elementwise_dtypes(
        h, type_promotion_kind=ct.ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
    ) == (torch.float32, torch.float16)
    assert ct.reduction_dtypes(a, ct.REDUCTION_OUTPUT_TYPE_KIND.SAME)[1] == torch.int64


def test_decomposition_table_has_what_we_rely_on():
    aten = torch.ops.aten
    for op in (
        aten.addcmul.default,
        aten.native_dropout_backward.default,
        aten.slice_backward.default,
    ):
        assert op in ct.decomposition_table, op


def test_set_tensor_data_changes_metadata_keeps_object():
    a = torch.zeros(2).to("tpu")
    b = torch.ones(3, dtype=torch.float64).to("tpu")
    ident = id(a)
    ct.set_tensor_data(a, b)
    assert id(a) == ident and a.shape == (3,) and a.dtype == torch.float64


def test_set_math_bits():
    t = torch.zeros(2, dtype=torch.complex64)
    ct.set_math_bits(t, True, False)
    assert t.is_conj() and not t.is_neg()
    ct.set_math_bits(t, False, True)
    assert not t.is_conj() and t.is_neg()


def test_tensor_repr():
    t = torch.tensor([1.0, 2.0]).to("tpu")
    assert ct.tensor_repr(t, t.cpu()) == "tensor([1., 2.], device='tpu:0')"


def test_all_op_schemas_lists_foreach_ops():
    names = {s.name for s in ct.all_op_schemas()}
    assert "aten::_foreach_add_" in names and "aten::add" in names
