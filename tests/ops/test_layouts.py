"""Result layouts of functional ops on inputs out of row-major order, against CPU
(torchjax/ops/layouts.py, Note [Result layouts follow CPU])."""

import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax.ops import layouts
from torchjax.testing import opinfo as oi

TPU = "tpu"


def _transposed(x):
    """``x`` with the same values and its last two dimensions swapped in memory."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _both(fn, *inputs):
    """``fn`` on the CPU inputs and on tpu copies of them (layouts kept by ``.to``)."""
    return fn(*inputs), fn(*(t.to(TPU) for t in inputs))


def _same(got, want):
    assert got.device.type == TPU
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert got.is_contiguous() == want.is_contiguous()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_code_that_views_a_transposed_result_runs_as_on_cpu():
    # The result of an op on y.t() is laid out like y.t(): its transpose is contiguous
    # again, so view(-1) works on CPU and must on tpu.
    y = torch.arange(12.0).reshape(3, 4)
    want, got = _both(lambda t: (t.t() * 2).t().view(-1), y)
    torch.testing.assert_close(got.cpu(), want)


CASES = {
    "unary": (lambda x: torch.exp(x.t()), [(3, 4)]),
    "binary, both transposed": (lambda x, y: x.t() + y.t(), [(3, 4), (3, 4)]),
    "binary, transposed and contiguous": (lambda x, y: x.t() * y, [(3, 4), (4, 3)]),
    "contiguous first, transposed second": (lambda x, y: y - x.t(), [(3, 4), (4, 3)]),
    "broadcast row": (lambda x, y: x.t() + y, [(3, 4), (3,)]),
    "where": (lambda x, y: torch.where(x.t() > 0, x.t(), y), [(3, 4), (4, 3)]),
    "clamp": (lambda x: x.t().clamp(-0.5, 0.5), [(3, 4)]),
    "lerp": (lambda x, y: torch.lerp(x.t(), y, 0.3), [(3, 4), (4, 3)]),
    "gelu": (lambda x: F.gelu(x.t()), [(3, 4)]),
    "keepdim sum": (lambda x: x.t().sum(0, keepdim=True), [(3, 4)]),
    "3-d permute": (lambda x: torch.sigmoid(x.permute(2, 0, 1)), [(2, 3, 4)]),
    "channels_last relu": (
        lambda x: F.relu(x.contiguous(memory_format=torch.channels_last)),
        [(2, 3, 4, 5)],
    ),
    "channels_last add": (
        lambda x, y: x.contiguous(memory_format=torch.channels_last) + y,
        [(2, 3, 4, 5), (2, 3, 4, 5)],
    ),
    "channels_last conv2d": (
        lambda x, w: F.conv2d(x.contiguous(memory_format=torch.channels_last), w, padding=1),
        [(2, 3, 5, 5), (4, 3, 3, 3)],
    ),
    "channels_last weight only": (
        lambda x, w: F.conv2d(x, w.contiguous(memory_format=torch.channels_last)),
        [(2, 3, 5, 5), (4, 3, 3, 3)],
    ),
    "channels_last conv_transpose2d": (
        lambda x, w: F.conv_transpose2d(x.contiguous(memory_format=torch.channels_last), w),
        [(2, 3, 4, 4), (3, 2, 3, 3)],
    ),
    "softmax of a transpose": (lambda x: torch.softmax(x.t(), -1), [(3, 4)]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_result_strides_and_values_match_cpu(name, dtype):
    fn, shapes = CASES[name]
    torch.manual_seed(0)
    inputs = [torch.randn(s).to(dtype) for s in shapes]
    want, got = _both(fn, *inputs)
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)


def test_int64_values_past_int32_keep_their_layout():
    x = torch.tensor([[2**40, 1, 2], [3, 2**33, 5]])
    want, got = _both(lambda t: t.t() * 3, x)
    _same(got, want)
    assert got.dtype == torch.int64


def test_writes_through_a_laid_out_result_reach_its_views():
    # The storage made on first read holds the data in memory order: a view of the
    # result and a partial write see the same elements as on CPU.
    def run(d):
        y = torch.arange(12.0, device=d).reshape(3, 4)
        z = y.t() + 1
        col = z.t()[1]
        z[0, 1] = 100.0
        flat = z.as_strided((12,), (1,))
        return z, col, flat

    for want, got in zip(run("cpu"), run(TPU)):
        _same(got, want)


def test_a_laid_out_result_costs_no_second_program():
    # The value is the op's own output; the storage in memory order is made only when
    # read, so one op on a transposed input is one XLA execution.
    # (Plain eager's count; the next test is fused eager's.)
    x = torch.randn(8, 16, device=TPU)
    xt = x.t()
    with torchjax.fused(False):
        torch.exp(xt)  # compiles
        torchjax.reset_stats()
        r = torch.exp(xt)
    assert r.stride() == (1, 16)
    assert torchjax.stats()["executions"] == 1
    torch.testing.assert_close(r.cpu(), torch.exp(x.cpu().t()))


def test_fused_eager_records_laid_out_results_in_one_segment():
    def run(y):
        a = y.t() * 2
        b = a + 1  # reads a whole: its logical value
        return a, b.t().reshape(-1)  # reads b's storage in memory order

    y = torch.randn(3, 4)
    want_a, want = run(y)
    yt = y.to(TPU)
    torch.tpu.synchronize()
    torchjax.reset_stats()
    with torchjax.fused():
        a, got = run(yt)
        assert a.stride() == want_a.stride() == (1, 4)
        out = got.cpu()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(a.cpu(), want_a)
    assert torchjax.stats()["fused_segments"] == 1


@pytest.mark.parametrize(
    "size, stride, expected",
    [
        ((3, 4), (4, 1), False),  # contiguous
        ((3, 2), (4, 1), False),  # a slice
        ((3, 4), (0, 1), False),  # an expanded row
        ((4, 3), (1, 0), False),  # an expanded column
        ((1, 4), (1, 1), False),  # size-1 dimensions have any stride
        ((4, 3), (1, 4), True),  # a transpose
        ((2, 3, 4, 5), (60, 1, 15, 3), True),  # channels_last
    ],
)
def test_only_inputs_out_of_row_major_order_reach_the_meta_kernel(size, stride, expected):
    assert layouts.out_of_order(size, stride) is expected


# Elementwise OpInfos whose results CPU lays out like their inputs.
_OPINFO_NAMES = [
    "abs", "neg", "exp", "sin", "tanh", "sigmoid", "sqrt", "floor", "sign", "isnan",
    "add", "sub", "mul", "div", "maximum", "pow", "atan2", "where", "clamp", "lerp",
    "addcmul", "addcdiv", "logit", "nn.functional.gelu", "nn.functional.leaky_relu",
    "nn.functional.hardtanh", "nn.functional.softshrink",
]  # fmt: skip


@pytest.mark.parametrize("opinfo", oi.opinfos(_OPINFO_NAMES), ids=oi.full_name)
def test_opinfo_results_on_transposed_inputs_have_cpu_strides(opinfo):
    fn = opinfo.get_op()
    compared = 0
    for sample in oi.samples(opinfo, torch.float32, limit=8):
        moved = oi.map_tensors(
            lambda t: _transposed(t) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t,
            sample,
        )
        want = oi.call(fn, moved)
        got = oi.call(fn, oi.to_tpu(moved, opinfo))
        if isinstance(want, torch.Tensor) and want.dim() >= 2:
            assert got.stride() == want.stride(), (got.stride(), want.stride())
            compared += 1
    assert compared, "no sample had a 2-d result"
