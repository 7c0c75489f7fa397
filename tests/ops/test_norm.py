"""Tests for torchjax/ops/norm.py: OpInfo sweep plus what OpInfo misses."""

import math

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests

OPS = [
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.rms_norm",
    "nn.functional.batch_norm",
    "nn.functional.batch_norm.without_cudnn",
    "nn.functional.instance_norm",
    "native_layer_norm",
    "native_batch_norm",
    "native_group_norm",
    "_native_batch_norm_legit",
    "_batch_norm_with_update",
    "softmax",
    "softmax.with_dtype",
    "log_softmax",
    "log_softmax.with_dtype",
    "_softmax_backward_data",
]
globals().update(make_tests(OPS))


def test_batch_norm_updates_running_stats_in_place():
    x = torch.randn(4, 3, 5)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    trm, trv = rm.to("tpu"), rv.to("tpu")
    view = trv[1:]
    want = F.batch_norm(x, rm, rv, training=True, momentum=0.3)
    got = F.batch_norm(x.to("tpu"), trm, trv, training=True, momentum=0.3)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(trm.cpu(), rm)
    torch.testing.assert_close(trv.cpu(), rv)
    torch.testing.assert_close(view.cpu(), rv[1:])


def test_batchnorm_module_train_eval_backward():
    m = torch.nn.BatchNorm2d(3).double()
    tm = torch.nn.BatchNorm2d(3).double().to("tpu")
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for train in (True, False):
        m.train(train)
        tm.train(train)
        cx, tx = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
        m(cx).pow(2).sum().backward()
        tm(tx).pow(2).sum().backward()
        torch.testing.assert_close(tx.grad.cpu(), cx.grad)
        torch.testing.assert_close(tm.weight.grad.cpu(), m.weight.grad)
        torch.testing.assert_close(tm.running_var.cpu(), m.running_var)
        assert int(tm.num_batches_tracked) == int(m.num_batches_tracked)


def test_softmax_half_to_float_and_0d():
    x = torch.randn(3, 4).half()
    got = torch.softmax(x.to("tpu"), dim=1, dtype=torch.float32)
    torch.testing.assert_close(got.cpu(), torch.softmax(x, dim=1, dtype=torch.float32))
    s = torch.tensor(2.0)
    torch.testing.assert_close(torch.log_softmax(s.to("tpu"), 0).cpu(), torch.log_softmax(s, 0))


def test_softmax_inf_and_empty():
    x = torch.tensor([[float("-inf"), 0.0, 1.0], [float("-inf")] * 3])
    torch.testing.assert_close(
        torch.softmax(x.to("tpu"), 1).cpu(), torch.softmax(x, 1), equal_nan=True
    )
    e = torch.randn(0, 3)
    assert torch.softmax(e.to("tpu"), 1).shape == (0, 3)


def test_softmax_dim_error():
    with pytest.raises(IndexError, match="aten::_softmax: dimension out of range"):
        torch.ops.aten._softmax(torch.randn(2, 3).to("tpu"), 2, False)


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_fused_rms_norm_direct(eps):
    x, w = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    got = torch.ops.aten._fused_rms_norm(x.to("tpu"), [8], w.to("tpu"), eps)
    want = F.rms_norm(x, (8,), w, eps)
    torch.testing.assert_close(got[0].cpu(), want)
    go = torch.randn(2, 3, 8, dtype=torch.float64)
    cx, cw = x.clone().requires_grad_(), w.clone().requires_grad_()
    gx, gw = torch.autograd.grad((F.rms_norm(cx, (8,), cw, eps) * go).sum(), (cx, cw))
    tg = torch.ops.aten._fused_rms_norm_backward(
        go.to("tpu"), x.to("tpu"), [8], got[1], w.to("tpu"), [True, True]
    )
    torch.testing.assert_close(tg[0].cpu(), gx)
    torch.testing.assert_close(tg[1].cpu(), gw)


def test_layer_norm_shape_error():
    with pytest.raises(RuntimeError, match="aten::native_layer_norm"):
        F.layer_norm(torch.randn(2, 3).to("tpu"), (4,))


@pytest.mark.parametrize("shape", [(0, 2), (0, 4, 3)])
def test_group_norm_empty_batch(shape):
    # An empty batch once failed in the lowering's reshape (JAX refused it).
    x, w, b = torch.randn(shape), torch.randn(shape[1]), torch.randn(shape[1])
    args = (0, shape[1], math.prod(shape[2:]), 2, 1e-5)
    expected = torch.native_group_norm(x, w, b, *args)
    got = torch.native_group_norm(x.to("tpu"), w.to("tpu"), b.to("tpu"), *args)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype
    assert F.group_norm(x.to("tpu"), 2, w.to("tpu"), b.to("tpu")).shape == x.shape


_WEIGHT_NORM = [
    ("linear dim 0", lambda: torch.nn.Linear(4, 3), 0, (2, 4), torch.float32),
    ("linear last dim", lambda: torch.nn.Linear(4, 3), 1, (2, 4), torch.float32),
    ("conv dim 0", lambda: torch.nn.Conv2d(2, 3, 3), 0, (1, 2, 5, 5), torch.float32),
    ("conv last dim", lambda: torch.nn.Conv1d(2, 3, 3), 2, (1, 2, 6), torch.float32),
    ("linear bf16", lambda: torch.nn.Linear(8, 5), 0, (3, 8), torch.bfloat16),
]


@pytest.mark.parametrize("case", _WEIGHT_NORM, ids=[c[0] for c in _WEIGHT_NORM])
@pytest.mark.parametrize("api", ["parametrizations", "legacy"])
def test_weight_norm_backward_matches_cpu(case, api):
    # Backward reaches aten::_weight_norm_interface_backward for the first or last dim.
    _, make, dim, shape, dtype = case
    grads = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        module = make().to(dtype)
        if api == "parametrizations":
            module = torch.nn.utils.parametrizations.weight_norm(module, dim=dim)
        else:
            module = torch.nn.utils.weight_norm(module, dim=dim)
        module = module.to(device)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        module(x.to(device)).float().square().sum().backward()
        grads[device] = {n: p.grad.cpu() for n, p in module.named_parameters()}
    assert len(grads["cpu"]) == 3  # g, v and the bias
    assert grads["tpu"].keys() == grads["cpu"].keys()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name, want in grads["cpu"].items():
        assert grads["tpu"][name].dtype == want.dtype, name
        torch.testing.assert_close(grads["tpu"][name], want, **tol, msg=name)


def test_weight_norm_backward_of_a_middle_dim_refuses_as_cpu():
    for device in ("cpu", "tpu"):
        v = torch.randn(2, 3, 4, device=device)
        g = torch.ones(1, 3, 1, device=device)
        with pytest.raises(RuntimeError, match="fused kernels can only be applied for first"):
            torch.ops.aten._weight_norm_interface_backward(v, v, g, g, 1)
