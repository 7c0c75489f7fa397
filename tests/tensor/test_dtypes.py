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


_FIT_DTYPES = ALL + [
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
_FIT_VALUES = [
    1e300, -1e300, float("nan"), float("inf"), -float("inf"), 2**63 - 1, 2**63, -(2**63),
    -1, -255, -256, 127, 128, -129, 255, 256, 2.7, -0.5, 70000, 65504.0, 65504.5,
    3.4028234663852886e38, 3.5e38, 448.0, 448.5, 57344.0, 57345.0, 1 + 2j, 1e39j, True,
]  # fmt: skip


@pytest.mark.parametrize("dtype", _FIT_DTYPES, ids=str)
def test_check_scalar_fits_agrees_with_torch(dtype):
    # c10's checked_convert, as torch.full on CPU applies it.
    checked = 0
    for v in _FIT_VALUES:
        try:
            torch.full((2,), v, dtype=dtype)
            want = None
        except RuntimeError as e:
            want = str(e)
        except (OverflowError, TypeError):
            continue  # refused by the Python binding before c10's check
        try:
            dtypes.check_scalar_fits(v, dtype, "full")
            got = None
        except RuntimeError as e:
            got = str(e).removesuffix(" (in aten::full)")
        assert got == want, v
        checked += 1
    assert checked >= 20


_OVERFLOWING_CALLS = {
    "fill_": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).fill_(300),
    "full": lambda d: torch.full((2,), 300, dtype=torch.int8, device=d),
    "full_like": lambda d: torch.full_like(torch.tensor([1, 2], dtype=torch.int8, device=d), 300),
    "new_full": lambda d: torch.tensor([1], dtype=torch.int8, device=d).new_full((2,), -300),
    "setitem": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).__setitem__(0, 300),
    "fill_ bf16": lambda d: torch.zeros(2, dtype=torch.bfloat16, device=d).fill_(1e39),
    "fill_ f32": lambda d: torch.zeros(2, device=d).fill_(1e300),
    "masked_fill": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).masked_fill(
        torch.tensor([True, False], device=d), 300
    ),
    "masked_fill f16": lambda d: torch.zeros(2, dtype=torch.float16, device=d).masked_fill(
        torch.tensor([True, False], device=d), 1e6
    ),
    "where other": lambda d: torch.where(
        torch.tensor([True, False], device=d), torch.tensor([1, 2], dtype=torch.int8, device=d), 300
    ),
    "where self": lambda d: torch.where(
        torch.tensor([True, False], device=d),
        -300,
        torch.tensor([1, 2], dtype=torch.int8, device=d),
    ),
    "index_fill": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).index_fill(
        0, torch.tensor([0], device=d), 300
    ),
    "clamp": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).clamp(max=300),
    "clamp_min": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d).clamp_min(-300),
    "clamp_ f16": lambda d: torch.zeros(2, dtype=torch.float16, device=d).clamp_(min=-1e6),
    "scatter": lambda d: torch.zeros(3, dtype=torch.int8, device=d).scatter(
        0, torch.tensor([1], device=d), 300
    ),
    "pow": lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d) ** 300,
    "hardtanh": lambda d: torch.nn.functional.hardtanh(
        torch.zeros(2, dtype=torch.float16, device=d), -1e6, 1e6
    ),
    "pad": lambda d: torch.nn.functional.pad(
        torch.tensor([1, 2], dtype=torch.int8, device=d), (1, 1), value=300
    ),
}


@pytest.mark.parametrize("name", sorted(_OVERFLOWING_CALLS))
def test_numbers_that_do_not_fit_raise_as_on_cpu(name):
    # These kernels read the number as the tensor's type, with c10's overflow check:
    # writing 300 into int8 as 44 would be a silent wrong result.
    call = _OVERFLOWING_CALLS[name]
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="without overflow"):
            call(device)


def test_numbers_that_fit_or_wrap_as_torch_allows():
    u8 = torch.tensor([1, 2], dtype=torch.uint8)
    for call in (
        lambda t: t.fill_(-1),  # negative ints wrap into unsigned types
        lambda t: t + 300,  # arithmetic wraps the number, unchecked
        lambda t: torch.where(t > 1, t, 255),
        lambda t: t.clamp(max=2.7),  # a float bound promotes to float
    ):
        want = call(u8.clone())
        assert torch.equal(call(u8.clone().to("tpu")).cpu(), want)


def test_one_element_half_fills_are_unchecked_as_on_cpu():
    # CPU fills a one-element tensor through a path that checks every type but the half
    # types: where(cond, x_f16, 1e5) gives inf, while int8 still raises.
    for device in ("cpu", "tpu"):
        cond = torch.tensor([True, False], device=device)
        x = torch.ones(2, dtype=torch.float16, device=device)
        assert torch.where(cond, x, 1e5)[1].item() == float("inf")
        assert torch.ones(1, dtype=torch.bfloat16, device=device).fill_(1e39).item() == float("inf")
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.ones(2, dtype=torch.float16, device=device).fill_(1e5)
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.where(cond, torch.ones(2, dtype=torch.int8, device=device), 300)


def test_float64_on_an_emulating_platform_warns_once(monkeypatch):
    # Note [float64 on TPU]: XLA:TPU keeps float64 only inside float32's exponent range;
    # the first float64/complex128 tensor there says so, once. Here CPU stands in for it.
    import warnings

    from torchjax.tensor import _tensor

    monkeypatch.setitem(dtypes.EMULATED_FLOAT64, "cpu", "emulated here")
    monkeypatch.setattr(dtypes, "_WARNED", set())
    monkeypatch.setattr(_tensor, "_CONTIGUOUS_META", {})  # every shape new again
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.ones(7, 5, dtype=torch.float32, device="tpu") * 2  # not 64-bit: nothing
        assert not seen
        x = torch.tensor([1e-300, 3.0], dtype=torch.float64).to("tpu")
        (x * 3).sum()
        torch.zeros(6, 9, dtype=torch.complex128, device="tpu")
    messages = [str(w.message) for w in seen if w.category is UserWarning]
    assert len(messages) == 1, messages
    assert "float64/complex128 tensors on cpu: emulated here" in messages[0]
    assert "below ~1.2e-38 become 0" in messages[0] and ".cpu()" in messages[0]


def test_float64_on_cpu_jax_says_nothing():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.arange(11, dtype=torch.float64, device="tpu").exp()
