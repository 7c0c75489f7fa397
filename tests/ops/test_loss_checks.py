"""Tests for torchjax/ops/loss_checks.py: the loss ops refuse what CPU refuses by its
values, with CPU's exception and text, eager, under torchjax.jit and under
torch.compile(backend="tpu"); valid calls still give CPU's values."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.value_checks import MODES, Host, assert_computes_as_cpu, assert_refused_as_cpu

_BCE = "binary_cross_entropy"
_T = torch.tensor

# name -> (fn, args, the op a deferred check names, or None for a check made at the op)
REFUSED = {
    "bce input above 1": (F.binary_cross_entropy, (_T([0.5, 1.5]), _T([1.0, 0.0])), _BCE),
    "bce input below 0": (F.binary_cross_entropy, (_T([-0.2, 0.5]), _T([1.0, 0.0])), _BCE),
    "bce NaN input": (F.binary_cross_entropy, (_T([float("nan")]), _T([1.0])), _BCE),
    "bce target above 1": (F.binary_cross_entropy, (_T([0.5]), _T([2.0])), _BCE),
    "bce NaN target": (F.binary_cross_entropy, (_T([0.5]), _T([float("nan")])), _BCE),
    # The first bad element decides: its target here, though a later input is bad too.
    "bce target first": (F.binary_cross_entropy, (_T([0.5, 2.0]), _T([2.0, 0.5])), _BCE),
    "bce input first": (F.binary_cross_entropy, (_T([2.0, 0.5]), _T([0.5, 2.0])), _BCE),
    "bce with weight": (
        lambda x, y, w: F.binary_cross_entropy(x, y, weight=w, reduction="sum"),
        (
            _T([[0.5, 1.5]], dtype=torch.float64),
            _T([[1.0, 0.0]], dtype=torch.float64),
            _T([2.0, 1.0], dtype=torch.float64),
        ),
        _BCE,
    ),
    "multi_margin target too large": (
        F.multi_margin_loss,
        (torch.zeros(2, 3), _T([1, 4])),
        "multi_margin_loss",
    ),
    "multi_margin negative target": (
        F.multi_margin_loss,
        (torch.zeros(1, 3), _T([-1])),
        "multi_margin_loss",
    ),
    "multilabel target too large": (
        F.multilabel_margin_loss,
        (torch.zeros(1, 3), _T([[4, -1, 0]])),
        None,
    ),
    # CPU checks every entry, those after the first -1 too, and refuses below -1.
    "multilabel target after -1": (
        F.multilabel_margin_loss,
        (torch.zeros(1, 3), _T([[0, -1, 7]])),
        None,
    ),
    "multilabel target below -1": (
        F.multilabel_margin_loss,
        (torch.zeros(2, 3), _T([[0, 1, 2], [-2, 1, 0]])),
        None,
    ),
}


def _ctc(t, n, c, targets, il, tl, **kw):
    log_probs = torch.randn(t, n, c, generator=torch.Generator().manual_seed(0)).log_softmax(2)
    return (lambda lp, tg, i, n: F.ctc_loss(lp, tg, i, n, **kw)), (log_probs, targets, il, tl)


def _ctc_lists(t, n, c, targets, il, tl):
    log_probs = torch.randn(t, n, c, generator=torch.Generator().manual_seed(0)).log_softmax(2)
    return (lambda lp, tg: F.ctc_loss(lp, tg, il, tl)), (log_probs, targets)


CTC_REFUSED = {
    "input length above T": _ctc(2, 1, 3, _T([[1]]), _T([5]), _T([1])),
    "negative input length": _ctc(2, 1, 3, _T([[1]]), _T([-1]), _T([1])),
    "target length above S": _ctc(4, 1, 3, _T([[1, 2]]), _T([4]), _T([3])),
    "negative target length": _ctc(4, 1, 3, _T([[1, 2]]), _T([4]), _T([-1])),
    "concatenated targets too short": _ctc(4, 2, 3, _T([1, 2]), _T([4, 4]), _T([1, 2])),
    "second sample's input length": _ctc(3, 2, 3, _T([[1], [2]]), _T([3, 4]), _T([1, 1])),
    "list input length above T": _ctc_lists(2, 1, 3, _T([[1]]), [5], [1]),
    "list target length above S": _ctc_lists(4, 1, 3, _T([[1, 2]]), [4], [3]),
    "blank out of range": _ctc(2, 1, 3, _T([[1]]), _T([2]), _T([1]), blank=3),
    "input lengths of another size": _ctc(2, 1, 3, _T([[1]]), _T([2, 2]), _T([1])),
    "CPU length tensors": _ctc(2, 1, 3, _T([[1]]), Host(_T([5])), Host(_T([1]))),
    "int32 length tensors": _ctc(
        2, 1, 3, _T([[1]]), _T([5], dtype=torch.int32), _T([1], dtype=torch.int32)
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_losses_refuse_values_as_cpu(name):
    fn, args, deferred_in = REFUSED[name]
    assert assert_refused_as_cpu(fn, *args, deferred_in=deferred_in) == len(MODES)


# CPU's torch.compile raises these at the call, plain: ctc_loss's fake propagation meets a
# data-dependent output and Dynamo runs the op eagerly (Note [Errors of ops traced with
# fake tensors] in torchjax/tensor/_fake_errors.py); so does ours.
@pytest.mark.parametrize("name", sorted(CTC_REFUSED))
def test_ctc_loss_refuses_lengths_at_the_op_as_cpu(name):
    # CPU and CUDA read the lengths on the host: raised by the call, CPU's text.
    fn, args = CTC_REFUSED[name]
    assert assert_refused_as_cpu(fn, *args) == len(MODES)


VALID = {
    "bce bounds": (F.binary_cross_entropy, (_T([0.0, 1.0, 0.3]), _T([0.0, 1.0, 0.7]))),
    "bce float64": (
        F.binary_cross_entropy,
        (_T([[0.2, 0.9]], dtype=torch.float64), _T([[1.0, 0.0]], dtype=torch.float64)),
    ),
    "multi_margin": (F.multi_margin_loss, (_T([[0.1, 0.5, -0.3]]), _T([2]))),
    "multilabel": (F.multilabel_margin_loss, (_T([[0.1, 0.5, -0.3]]), _T([[2, -1, 0]]))),
    "ctc padded": _ctc(4, 2, 3, _T([[1, 2], [2, 0]]), _T([4, 3]), _T([2, 1])),
    "ctc concatenated": _ctc(4, 2, 3, _T([1, 2, 2]), _T([4, 3]), _T([1, 2])),
    "ctc lists": _ctc_lists(4, 2, 3, _T([[1, 2], [2, 0]]), [4, 3], [2, 1]),
    "ctc CPU lengths": _ctc(4, 2, 3, _T([[1, 2], [2, 0]]), Host(_T([4, 3])), Host(_T([2, 1]))),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_losses_compute_as_cpu(name):
    fn, args = VALID[name]
    assert assert_computes_as_cpu(fn, *args) == len(MODES)


def test_bce_check_is_deferred_to_the_next_sync():
    # CUDA asserts in the kernel: the op returns, the next synchronisation point raises,
    # and the error names the op.
    out = F.binary_cross_entropy(_T([1.5]).to("tpu"), _T([1.0]).to("tpu"))
    with pytest.raises(RuntimeError) as info:
        out.item()
    assert str(info.value) == (
        "all elements of input should be between 0 and 1 (in aten::binary_cross_entropy)"
    )


def test_bce_module_and_backward():
    x = _T([0.2, 0.7], requires_grad=True)
    y = _T([1.0, 0.0])
    tx = x.detach().to("tpu").requires_grad_()
    torch.nn.BCELoss()(x, y).backward()
    torch.nn.BCELoss()(tx, y.to("tpu")).backward()
    torch.testing.assert_close(tx.grad.cpu(), x.grad)
    with pytest.raises(RuntimeError, match="all elements of target should be between 0 and 1"):
        torch.nn.BCELoss()(tx, _T([1.0, 3.0]).to("tpu")).backward()


def test_cpu_compile_raises_ctc_loss_length_errors_at_the_call():
    # The premise of the test above: CPU's torch.compile does not wrap these.
    fn, args = CTC_REFUSED["blank out of range"]
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as info:
        torch.compile(fn, backend="eager")(*args)
    assert type(info.value) is RuntimeError
    assert str(info.value) == "blank must be in label range"
