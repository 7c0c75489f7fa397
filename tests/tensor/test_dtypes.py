"""Honest dtypes: the dtype a tpu tensor reports is the dtype of its jax array."""

import numpy as np
import pytest
import torch

import torchjax
from torchjax.tensor import dtypes

ALL = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_roundtrip_every_dtype(dtype):
    x = (torch.arange(-3, 5) * 3).to(dtype) if dtype != torch.bool else torch.tensor([True, False])
    y = x.to("tpu")
    assert y.dtype == dtype
    assert torchjax.to_jax(y).dtype == dtypes.to_jax_dtype(dtype)
    back = y.cpu()
    assert back.dtype == dtype and torch.equal(back, x)


def test_int64_past_2_31_and_float64_exact():
    big = torch.tensor([2**40 + 3, -(2**62) + 1], dtype=torch.int64)
    t = big.to("tpu")
    assert t.dtype == torch.int64
    assert t.cpu().tolist() == big.tolist()
    assert t[0].item() == 2**40 + 3
    f = torch.tensor([1 / 3, 1e300, 2.0**-1070], dtype=torch.float64)
    assert torch.equal(f.to("tpu").cpu(), f)


def test_float8_roundtrip():
    x = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    y = x.to("tpu")
    assert y.dtype == torch.float8_e4m3fn
    assert torch.equal(y.cpu().float(), x.float())


def test_default_dtypes_like_torch():
    assert torch.arange(5, device="tpu").dtype == torch.int64
    assert torch.zeros(2, device="tpu").dtype == torch.float32
    assert torch.tensor([1.0], device="tpu").dtype == torch.float32
    assert torch.tensor([True], device="tpu").dtype == torch.bool


def test_sin_of_int64_is_float32():
    x = torch.tensor([0, 1, 2]).to("tpu")
    y = torch.sin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), torch.sin(torch.tensor([0, 1, 2])))


def test_half_and_bfloat16_math():
    for dt in (torch.float16, torch.bfloat16):
        a = torch.tensor([1.5, 2.25, -3.0], dtype=dt)
        got = (a.to("tpu") * 2 + 1).cpu()
        assert got.dtype == dt
        assert torch.equal(got, a * 2 + 1)


def test_to_dtype_on_tpu():
    x = torch.tensor([1.7, -2.2]).to("tpu")
    assert x.to(torch.int64).tolist() == [1, -2]
    assert x.to(torch.float64).dtype == torch.float64
    assert x.double().cpu().dtype == torch.float64
    assert x.half().dtype == torch.float16


def test_unsupported_dtype_message():
    with pytest.raises(TypeError, match="no JAX equivalent"):
        dtypes.to_jax_dtype(torch.quint8)


def test_numpy_bfloat16_bridge():
    a = np.array([1.0, 2.5], dtype=dtypes.to_jax_dtype(torch.bfloat16))
    t = dtypes.numpy_to_cpu_tensor(a)
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, 2.5]


def test_aten_type_name_matches_torch_messages():
    assert dtypes.aten_type_name(torch.float32) == "Float"
    assert dtypes.aten_type_name(torch.int64) == "Long"
    assert dtypes.aten_type_name(dtypes.to_jax_dtype(torch.bfloat16)) == "BFloat16"
    assert dtypes.aten_type_name(np.dtype(np.uint8)) == "Byte"
