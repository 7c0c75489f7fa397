"""Tests for torchjax/ops/dropout.py. Masks come from torchjax's RNG, not CPU torch's, so
training-mode dropout is checked by its values where kept, its statistics and its
determinism; eval mode and the backward by OpInfo against CPU."""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi

# Deterministic OpInfos of the family (dropout in eval mode is identity).
OPS = ["native_dropout_backward", "nn.functional.feature_alpha_dropout.without_train"]
globals().update(make_tests(OPS))

N = 10_000


def test_opinfo_ids_exist():
    assert oi.opinfos(OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_native_dropout(dtype):
    x = torch.full((N,), 2.0, dtype=dtype, device="tpu")
    out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    assert out.dtype == dtype and mask.dtype == torch.bool and mask.shape == (N,)
    o, m = out.cpu().double(), mask.cpu()
    kept = (torch.full((1,), 2.0, dtype=dtype) * (1 / 0.75)).double()  # CPU's rounding
    assert torch.equal(o[m], kept.expand(int(m.sum()))) and (o[~m] == 0).all()
    assert abs(m.double().mean() - 0.75) < 0.03
    out, mask = torch.ops.aten.native_dropout(x, 0.25, False)
    assert torch.equal(out.cpu(), x.cpu()) and mask.cpu().all()
    g = torch.ops.aten.native_dropout_backward(
        torch.ones(N, dtype=dtype, device="tpu"),
        torch.ops.aten.native_dropout(x, 0.5, True)[1],
        2.0,
    )
    assert set(g.cpu().double().unique().tolist()) <= {0.0, 2.0}


def test_dropout_train_eval_and_edges():
    x = torch.randn(N, device="tpu")
    assert torch.equal(F.dropout(x, 0.5, training=False).cpu(), x.cpu())
    assert torch.equal(F.dropout(x, 0.0, training=True).cpu(), x.cpu())
    assert (F.dropout(x, 1.0, training=True).cpu() == 0).all()
    y = F.dropout(x, 0.5, training=True).cpu()
    kept = y != 0
    torch.testing.assert_close(y[kept], x.cpu()[kept] * 2)
    assert abs(kept.double().mean() - 0.5) < 0.03
    m = torch.nn.Dropout(0.3).to("tpu")
    m.eval()
    assert torch.equal(m(x).cpu(), x.cpu())
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
        F.dropout(x, 1.5)


def test_dropout_backward():
    x = torch.randn(1000, device="tpu", requires_grad=True)
    y = F.dropout(x, 0.4, training=True)
    y.sum().backward()
    kept = y.detach().cpu() != 0
    g = x.grad.cpu()
    torch.testing.assert_close(g[kept], torch.full_like(g[kept], 1 / 0.6))
    assert (g[~kept] == 0).all()


def test_alpha_dropout():
    x = torch.randn(N, device="tpu")
    assert torch.equal(F.alpha_dropout(x, 0.5, training=False).cpu(), x.cpu())
    y = F.alpha_dropout(x, 0.2, training=True).cpu()
    assert y.shape == (N,) and abs(y.mean()) < 0.1 and abs(y.std() - 1) < 0.1


def test_dropout_determinism():
    torch.manual_seed(5)
    a = F.dropout(torch.ones(100, device="tpu"), 0.5).cpu()
    torch.manual_seed(5)
    assert torch.equal(F.dropout(torch.ones(100, device="tpu"), 0.5).cpu(), a)


@pytest.mark.parametrize("p", [0.5, 0.3])
@pytest.mark.parametrize("shape", [(5, 5), (7,), ()])
def test_inplace_dropout_keeps_what_dropout_keeps(p, shape):
    """Note [One Bernoulli draw]: F.dropout(x, inplace=True) (aten::dropout_, i.e.
    bernoulli_(1 - p)) and F.dropout(x) (native_dropout) keep the same elements under one
    seed, as on CPU."""
    for dev in ("cpu", "tpu"):
        x = torch.randn(shape).to(dev)
        torch.manual_seed(1)
        functional = F.dropout(x, p)
        torch.manual_seed(1)
        inplace = F.dropout(x.clone(), p, inplace=True)
        torch.testing.assert_close(inplace.cpu(), functional.cpu())


def test_dropout_run_op_by_op_draws_as_compiled():
    # Note [Random ops compiled or not] (torchjax/ops/_seeded.py): once a shape's dropout
    # has compiled MAX_FLOAT_VARIANTS rates, a new rate runs op by op; it must keep the
    # elements the compiled in-place dropout keeps under the same seed, and move the
    # device's counter by one, as a compiled call does. (Before, it depended on which
    # rates earlier code had used in the process.)
    from torchjax.device._stats import cache_info
    from torchjax.ops.executables import MAX_FLOAT_VARIANTS
    from torchjax.tensor import random as tjr

    x = torch.randn(3, 11, device="tpu")
    for i in range(MAX_FLOAT_VARIANTS):
        F.dropout(x, 0.1113 + i / 97)  # rates no other test uses
    native = torch.ops.aten.native_dropout.default
    # A rate no other test in the process uses: executables are keyed by the rate, not
    # the shape, so a rate seen before would reuse its compiled key.
    p = 0.2718
    before = cache_info(native).op_by_op
    torch.manual_seed(1)
    functional = F.dropout(x, p)
    (_, counter) = tjr.get_state().numpy().view("uint64").tolist()
    assert cache_info(native).op_by_op == before + 1  # the call ran op by op
    assert counter == 1
    torch.manual_seed(1)
    inplace = F.dropout(x.clone(), p, inplace=True)
    torch.testing.assert_close(inplace.cpu(), functional.cpu())
