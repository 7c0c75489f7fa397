"""OpInfo sweep and direct tests for torchjax/ops/activation.py."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import grads_match

OPS = [
    "nn.functional.relu",
    "nn.functional.relu6",
    "nn.functional.gelu",
    "nn.functional.silu",
    "nn.functional.elu",
    "nn.functional.selu",
    "nn.functional.celu",
    "nn.functional.leaky_relu",
    "nn.functional.hardtanh",
    "nn.functional.softplus",
    "nn.functional.mish",
    "nn.functional.hardswish",
    "nn.functional.hardsigmoid",
    "nn.functional.logsigmoid",
    "nn.functional.glu",
    "nn.functional.threshold",
    "nn.functional.hardshrink",
    "nn.functional.softshrink",
    "nn.functional.tanhshrink",
    "nn.functional.softsign",
    "sigmoid",
    "tanh",
    "nn.functional.silu.complex",
]
globals().update(make_tests(OPS))


def _grad_check(fn, x):
    x = x.double().requires_grad_()
    t = x.detach().to("tpu").requires_grad_()
    fn(x).sum().backward()
    fn(t).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), x.grad)


X = torch.tensor([-30.0, -3.0, -2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 2.9, 3.0, 25.0])


@pytest.mark.parametrize(
    "fn",
    [
        F.relu,
        F.silu,
        F.mish,
        F.hardswish,
        F.hardsigmoid,
        F.logsigmoid,
        torch.sigmoid,
        torch.tanh,
        lambda x: F.gelu(x, approximate="tanh"),
        F.gelu,
        lambda x: F.elu(x, alpha=0.7),
        lambda x: F.leaky_relu(x, 0.2),
        lambda x: F.hardtanh(x, -2.0, 2.0),
        lambda x: F.softplus(x, beta=2.0, threshold=5.0),
        lambda x: F.threshold(x, 0.5, -1.0),
        F.selu,
        F.relu6,
    ],
)
def test_forward_and_grad_at_edges(fn):
    torch.testing.assert_close(fn(X.to("tpu")).cpu(), fn(X))
    _grad_check(fn, X)


def test_nan_propagates():
    x = torch.tensor([float("nan"), 1.0])
    for fn in (F.relu, F.gelu, F.silu, F.hardtanh, F.leaky_relu):
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x), equal_nan=True)


def test_inplace_activations_on_view():
    base = torch.randn(4, 5)
    t = base.to("tpu")
    F.relu_(t[1])
    F.relu_(base[1])
    F.leaky_relu_(t[:, 2], 0.3)
    F.leaky_relu_(base[:, 2], 0.3)
    F.elu_(t[3])
    F.elu_(base[3])
    torch.testing.assert_close(t.cpu(), base)


def test_glu_errors_and_grad():
    with pytest.raises(RuntimeError, match="aten::glu: Halving dimension must be even"):
        F.glu(torch.randn(2, 3).to("tpu"))
    _grad_check(lambda x: F.glu(x, 0), torch.randn(4, 3))


def test_relu_bool_raises():
    with pytest.raises(RuntimeError, match="aten::relu"):
        F.relu(torch.tensor([True]).to("tpu"))


def test_low_precision():
    for dt in (torch.float16, torch.bfloat16):
        x = X.to(dt)
        for fn in (F.gelu, F.silu, F.softplus, F.logsigmoid):
            got = fn(x.to("tpu"))
            assert got.dtype == dt
            torch.testing.assert_close(got.cpu(), fn(x), rtol=1.6e-2, atol=1e-2)


_G = torch.Generator().manual_seed(0)


def test_rrelu_eval_and_training_noise():
    x = torch.randn(1000, generator=_G)
    grads_match(lambda x: F.rrelu(x, 0.1, 0.3, training=False), x.double())
    t = x.to("tpu")
    out = F.rrelu(t, 0.1, 0.3, training=True).cpu()
    slope = out / x
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out[x > 0], x[x > 0])
    neg = slope[x < 0]
    assert neg.min() >= 0.1 and neg.max() <= 0.3 and neg.std() > 0.03
    torch.testing.assert_close(neg.mean(), torch.tensor(0.2), atol=0.01, rtol=0)


_SIGNED = [-0.0, 0.0, -1.0, 7.0, 6.0, float("nan"), -float("inf"), float("inf")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "fn",
    [
        F.relu,
        F.relu6,
        lambda t: F.hardtanh(t, 0.0, 6.0),
        lambda t: F.hardtanh(t, -0.0, 6.0),
        F.hardtanh,
        lambda t: F.relu(t.clone(), inplace=True),
    ],
)
def test_relu_family_keeps_negative_zero_as_cpu(fn, dtype):
    # ATen's relu is clamp_min(self, 0), hardtanh a clamp: self is kept where it equals
    # a bound, so relu(-0.0) is -0.0.
    x = torch.tensor(_SIGNED * 8, dtype=dtype)
    want, got = fn(x), fn(x.to("tpu")).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    numbers = ~want.isnan()
    assert torch.equal(got[numbers], want[numbers])
    assert torch.equal(got[numbers].signbit(), want[numbers].signbit())
    assert want[0].signbit()


@pytest.mark.parametrize(
    "call",
    [
        lambda d: F.leaky_relu(torch.tensor([1, -2], device=d)),
        lambda d: F.rrelu(torch.tensor([1, -2], device=d), training=True),
        lambda d: F.rrelu(torch.tensor([1, -2], device=d), training=False),
    ],
)
def test_leaky_relu_family_of_integers_refuses_as_cpu(call):
    for d in ("cpu", "tpu"):
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            call(d)
