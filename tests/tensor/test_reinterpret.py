"""Views across dtypes and math bits alias their base both ways, as on CPU
(Note [Views across dtypes] in torchjax/tensor/_reinterpret.py)."""

import re

import pytest
import torch

import torchjax  # noqa: F401


def _both(make):
    return make("cpu"), make("tpu")


def _same(cpu, tpu):
    assert tpu.device.type == "tpu"
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def _complex(dev):
    return torch.tensor([1 + 2j, 3 - 4j, -5 + 6j, 7 + 8j], dtype=torch.complex64, device=dev)


WRITES = {
    "real_item": lambda x: x.real.__setitem__(0, 5),
    "imag_item": lambda x: x.imag.__setitem__(1, 7),
    "real_assign": lambda x: setattr(x, "real", torch.arange(4.0, device=x.device)),
    "imag_assign": lambda x: setattr(x, "imag", torch.full((4,), -1.0, device=x.device)),
    "chained_imag": lambda x: x[1:].imag.__setitem__(0, 3),
    "imag_mul_": lambda x: x.imag.mul_(2),
    "view_as_real_row": lambda x: torch.view_as_real(x)[2].fill_(9),
    "view_as_real_col": lambda x: torch.view_as_real(x)[:, 1].add_(1),
    "real_view_int": lambda x: x.real.view(torch.int32).__setitem__(0, 0),
    "conj_item": lambda x: x.conj().__setitem__(0, 1 + 1j),
    "conj_add_": lambda x: x.conj().add_(1j),
    "conj_imag_item": lambda x: x.conj().imag.__setitem__(2, 10),
    "conj_real_mul_": lambda x: x.conj().real.mul_(-1),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_write_through_complex_views_reaches_base(name):
    cpu, tpu = _both(_complex)
    WRITES[name](cpu)
    WRITES[name](tpu)
    _same(cpu, tpu)


READS = {
    "real": lambda x: x.real,
    "imag": lambda x: x.imag,
    "view_as_real": torch.view_as_real,
    "conj": lambda x: x.conj(),
    "conj_imag": lambda x: x.conj().imag,
    "conj_real": lambda x: x.conj().real,
    "slice_imag": lambda x: x[1::2].imag,
    "view_int": lambda x: x.view(torch.int32),
    "view_f64": lambda x: x.view(torch.float64),
    "view_u8": lambda x: x.view(torch.uint8),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_views_see_later_writes_to_base(name):
    cpu, tpu = _both(_complex)
    vc, vt = READS[name](cpu), READS[name](tpu)
    assert (vt.is_conj(), vt.is_neg()) == (vc.is_conj(), vc.is_neg())
    assert (vt.shape, vt.stride(), vt.storage_offset()) == (
        vc.shape,
        vc.stride(),
        vc.storage_offset(),
    )
    for x in (cpu, tpu):
        x.mul_(2)
        x[3] = 0.5 - 0.25j
    _same(vc.resolve_conj().resolve_neg(), vt.resolve_conj().resolve_neg())
    _same(vc.sum(), vt.sum())


def test_view_as_complex_writes_reach_real_base():
    cpu, tpu = _both(lambda d: torch.arange(8.0, device=d).reshape(4, 2))
    for x in (cpu, tpu):
        z = torch.view_as_complex(x)
        z[1] = 10 - 1j
        z.imag.add_(100)
    _same(cpu, tpu)


@pytest.mark.parametrize(
    "src,dst",
    [
        (torch.float32, torch.int32),
        (torch.float32, torch.int16),
        (torch.int16, torch.float32),
        (torch.uint8, torch.int64),
        (torch.float32, torch.complex64),
        (torch.float64, torch.complex128),
        (torch.complex128, torch.float32),
        (torch.int8, torch.bool),
        (torch.bfloat16, torch.int16),
    ],
)
def test_view_dtype_aliases_both_ways(src, dst):
    def make(dev):
        return torch.arange(16, dtype=torch.int64).to(src).to(dev).reshape(2, 8)

    cpu, tpu = _both(make)
    vc, vt = cpu.view(dst), tpu.view(dst)
    assert (vt.shape, vt.stride(), vt.storage_offset()) == (
        vc.shape,
        vc.stride(),
        vc.storage_offset(),
    )
    _same(vc, vt)
    vc[-1, 0] = vc[0, 0]
    vt[-1, 0] = vt[0, 0]
    _same(cpu, tpu)
    cpu[0].zero_()
    tpu[0].zero_()
    _same(vc, vt)


@pytest.mark.parametrize(
    "make,dst",
    [
        (lambda d: torch.zeros(6, dtype=torch.int16, device=d)[1:5], torch.int32),
        (lambda d: torch.zeros(4, 6, dtype=torch.int16, device=d).t(), torch.int32),
        (lambda d: torch.zeros(5, dtype=torch.int16, device=d), torch.int32),
        (lambda d: torch.zeros(3, dtype=torch.float32, device=d), torch.complex64),
        (lambda d: torch.zeros(2, 4, dtype=torch.float32, device=d)[:, 1:3], torch.complex64),
        (lambda d: torch.zeros(2, dtype=torch.complex64, device=d).conj(), torch.float32),
    ],
)
def test_view_dtype_refusals_match_torch(make, dst):
    with pytest.raises(RuntimeError) as cpu_error:
        make("cpu").view(dst)
    with pytest.raises(type(cpu_error.value), match=_first_words(cpu_error.value)):
        make("tpu").view(dst)


def _first_words(error) -> str:
    return re.escape(str(error).split("\n")[0][:40])


def test_view_as_real_refuses_conj_and_view_as_complex_checks_layout():
    for make in (
        lambda d: torch.view_as_real(torch.zeros(2, dtype=torch.complex64, device=d).conj()),
        lambda d: torch.view_as_complex(torch.zeros(2, 3, device=d)),
        lambda d: torch.view_as_complex(torch.zeros(4, 2, device=d)[1:, :].t().contiguous().t()),
        lambda d: torch.view_as_complex(torch.zeros(5, device=d)[1:].view(2, 2)),
    ):
        with pytest.raises(RuntimeError) as cpu_error:
            make("cpu")
        with pytest.raises(RuntimeError, match=_first_words(cpu_error.value)):
            make("tpu")


def test_view_dtype_of_partial_storage_keeps_tail():
    # 3 int16 = 6 bytes: as int32 only the first whole element is visible.
    cpu, tpu = _both(lambda d: torch.tensor([1, 2, 3], dtype=torch.int16, device=d))
    for x in (cpu, tpu):
        x[:2].view(torch.int32).fill_(-1)
    _same(cpu, tpu)


def test_ops_read_the_logical_value_of_conj_and_neg_views():
    cpu, tpu = _both(_complex)
    for f in (
        lambda x: x.conj() + 1,
        lambda x: x.conj() @ x,
        lambda x: x.conj().clone(),
        lambda x: x.conj().imag * 3,
        lambda x: torch.mm(x.conj().view(1, 4), x.view(4, 1)),
        lambda x: x.conj().resolve_conj(),
        lambda x: x.conj().imag.resolve_neg(),
    ):
        _same(f(cpu), f(tpu))
