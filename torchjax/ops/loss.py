"""Loss lowerings the decomposition table lacks: multi_margin, multilabel_margin, CTC,
their backward ops, and the chunked linear_cross_entropy custom ops.

Most nn.functional losses (mse, l1, huber, smooth_l1, bce, nll, cross_entropy, kl_div,
soft_margin, ...) reach lowered ops through torch._decomp; tests/ops/test_loss.py checks
them all. Backward ops here are the ``jax.vjp`` of the forward lowering, except CTC whose
ATen gradient has an extra term (see ``_ctc_loss_backward``).

Under jit: nothing reads values, except that ``_ctc_loss.Tensor`` sizes its alpha table
from the concrete max target length in eager (the targets' width while tracing). Values
torch refuses (targets out of range, CTC lengths that do not fit, probabilities outside
[0, 1]) are checked in loss_checks.py, where torch checks them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax._compat.torch import decomposition_table
from torchjax.device import _checks
from torchjax.ops import executables, fused, fused_reads
from torchjax.ops.indexing import require_in_range
from torchjax.ops.loss_checks import (
    check_ctc_lengths,
    check_multi_margin_target,
    check_multilabel_target,
)
from torchjax.ops.registry import handler, lowering, precheck
from torchjax.ops.schema import arg
from torchjax.ops.writeback import check_castable
from torchjax.tensor._tensor import JaxTensor
from torchjax.tensor.dtypes import aten_type_name

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(x, reduction):
    if reduction == _MEAN:
        return x.mean()
    if reduction == _SUM:
        return x.sum()
    return x


def _vjp(fn, x, grad):
    _, pullback = jax.vjp(fn, x)
    return pullback(jnp.broadcast_to(grad.astype(x.dtype), jax.eval_shape(fn, x).shape))[0]


# ---------------------------------------------------------------------------------------
# multi_margin_loss


def _multi_margin(self, target, p, margin, weight, reduction):
    if p not in (1, 2):
        raise ValueError(f"aten::multi_margin_loss: only p == 1 and p == 2 supported, got {p}")
    x = self if self.ndim == 2 else self.reshape(1, -1)
    t = target.reshape(-1)
    if x.shape[0] != t.shape[0]:
        raise RuntimeError(
            f"aten::multi_margin_loss: inconsistent target size {tuple(target.shape)} for "
            f"input of size {tuple(self.shape)}"
        )
    c = x.shape[1]
    xt = jnp.take_along_axis(x, t[:, None], axis=1)
    z = jnp.maximum(margin - xt + x, 0)
    h = z if p == 1 else z * z
    if weight is not None:
        h = h * jnp.take(weight, t)[:, None].astype(h.dtype)
    h = jnp.where(jnp.arange(c)[None, :] == t[:, None], jnp.zeros((), h.dtype), h)
    loss = h.sum(axis=1) / c
    if self.ndim < 2:
        loss = loss.reshape(())
    return _reduce(loss, reduction)


@lowering(aten.multi_margin_loss)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=_MEAN):
    """aten::multi_margin_loss - sum_{j != y} w[y] * max(0, margin - x[y] + x[j])^p / C.

    Shapes: self (N, C) or (C,), target (N,) or () -> per-sample (N,) / () under
    reduction 'none', else a scalar. p is 1 or 2. Dtypes: self's.
    A target outside [0, C) raises at the next synchronisation point (a device check).
    Reference: ATen LossMultiMargin.cpp.
    """
    if target.size:
        check_multi_margin_target(target, self.shape[-1] if self.ndim else 1)
    return _multi_margin(self, target, p, margin, weight, reduction)


@lowering(aten.multi_margin_loss_backward)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=_MEAN):
    """aten::multi_margin_loss_backward - the vjp of aten::multi_margin_loss."""
    return _vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), self, grad_output)


# ---------------------------------------------------------------------------------------
# multilabel_margin_loss


def _multilabel_margin(self, target, reduction):
    x = self if self.ndim == 2 else self.reshape(1, -1)
    t = target.reshape(x.shape)
    c = x.shape[1]
    # Targets of a row are its entries before the first -1.
    valid = jnp.cumprod((t >= 0).astype(jnp.int32), axis=1).astype(bool)
    tc = jnp.clip(t, 0, c - 1)
    hit = (tc[:, :, None] == jnp.arange(c)[None, None, :]) & valid[:, :, None]
    is_target = hit.any(axis=1)
    xt = jnp.take_along_axis(x, tc, axis=1)
    h = jnp.maximum(1 - xt[:, :, None] + x[:, None, :], 0)
    keep = valid[:, :, None] & ~is_target[:, None, :]
    loss = jnp.where(keep, h, jnp.zeros((), h.dtype)).sum(axis=(1, 2)) / c
    if self.ndim < 2:
        loss = loss.reshape(())
    return _reduce(loss, reduction), is_target.astype(self.dtype).reshape(self.shape)


@lowering(aten.multilabel_margin_loss_forward)
def multilabel_margin_loss_forward(self, target, reduction):
    """aten::multilabel_margin_loss_forward - (loss, is_target).

    loss = sum_{j in targets, k not in targets} max(0, 1 - (x[j] - x[k])) / C, the targets
    of a row being its target entries before the first -1. Shapes: self, target (N, C) or
    (C,); is_target like self (0/1 in self's dtype). A target outside [-1, C) raises at
    the op, as on CPU. Reference: LossMultiLabelMargin.cpp.
    """
    check_multilabel_target(self, target)
    return _multilabel_margin(self, target, reduction)


@lowering(aten.multilabel_margin_loss_backward)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    """aten::multilabel_margin_loss_backward - the vjp of the forward's loss."""
    return _vjp(lambda x: _multilabel_margin(x, target, reduction)[0], self, grad_output)


# ---------------------------------------------------------------------------------------
# CTC
#
# Note [CTC sentinel]: alpha is computed in log space with a large finite stand-in for
# -inf, so that jax.vjp of logaddexp never sees (-inf) - (-inf) = NaN; entries below
# half of it are reported as -inf, as ATen has them.


def _neg(dtype):
    return jnp.asarray(jnp.finfo(dtype).min / 4, dtype=dtype)


def _ctc_targets(targets, target_lengths, n, s_max):
    s_max = max(s_max, 1)  # a gatherable width even when every target is empty
    if targets.ndim == 2:
        padded = (
            targets[:, :s_max]
            if targets.shape[1] >= s_max
            else jnp.pad(targets, ((0, 0), (0, s_max - targets.shape[1])))
        )
        return padded
    starts = jnp.cumsum(target_lengths) - target_lengths
    idx = starts[:, None] + jnp.arange(s_max)[None, :]
    return jnp.take(targets, jnp.clip(idx, 0, max(targets.shape[0] - 1, 0)), axis=0)


def _ctc_alpha(log_probs, targets, input_lengths, target_lengths, blank, s_max):
    t_max, n, _ = log_probs.shape
    dtype = log_probs.dtype
    neg = _neg(dtype)
    tgt = _ctc_targets(targets, target_lengths, n, s_max).astype(jnp.int64)
    s_ext = 2 * s_max + 1
    pos = jnp.arange(s_ext)
    # Extended labels: blank, l1, blank, l2, ..., blank.
    labels = jnp.where(pos[None, :] % 2 == 0, blank, jnp.take(tgt, pos // 2, axis=1, mode="clip"))
    labels = jnp.where(pos[None, :] < 2 * target_lengths[:, None] + 1, labels, blank)
    skip = (pos[None, :] % 2 == 1) & (pos[None, :] >= 2)
    skip = skip & (labels != jnp.roll(labels, 2, axis=1))
    in_range = pos[None, :] < 2 * target_lengths[:, None] + 1

    def emit(t):
        return jnp.take_along_axis(log_probs[t], labels, axis=1)

    init = jnp.where((pos[None, :] < 2) & in_range, emit(0), neg)

    def step(alpha, t):
        a1 = jnp.concatenate([jnp.full((n, 1), neg, dtype), alpha[:, :-1]], axis=1)
        a2 = jnp.concatenate([jnp.full((n, 2), neg, dtype), alpha[:, :-2]], axis=1)
        a2 = jnp.where(skip, a2, neg)
        new = jnp.logaddexp(jnp.logaddexp(alpha, a1), a2) + emit(t)
        new = jnp.maximum(jnp.where(in_range, new, neg), neg)
        new = jnp.where((t < input_lengths)[:, None], new, alpha)
        return new, new

    final, rest = lax.scan(step, init, jnp.arange(1, t_max))
    alphas = jnp.concatenate([init[None], rest], axis=0)
    last = 2 * target_lengths
    a_last = jnp.take_along_axis(final, last[:, None], axis=1)[:, 0]
    a_prev = jnp.take_along_axis(final, jnp.maximum(last - 1, 0)[:, None], axis=1)[:, 0]
    a_prev = jnp.where(target_lengths > 0, a_prev, neg)
    nll = -jnp.logaddexp(a_last, a_prev)
    return nll, jnp.moveaxis(alphas, 0, 1)


def _ctc_args(op, log_probs, targets, input_lengths, target_lengths):
    if log_probs.ndim != 3:
        raise RuntimeError(f"{op}: expected 3-D log_probs (T, N, C), got {log_probs.ndim}-D")
    if isinstance(target_lengths, (list, tuple)):
        s_max = max(target_lengths, default=0)
    elif isinstance(target_lengths, jax.core.Tracer):
        s_max = targets.shape[1] if targets.ndim == 2 else targets.shape[0]
    else:
        # Concrete values (op by op, or a constant of a trace): read on the host, since
        # jnp.max inside a trace would give a tracer even of a constant.
        s_max = int(np.max(np.asarray(target_lengths), initial=0))
    il = jnp.asarray(input_lengths, dtype=jnp.int64).reshape(-1)
    tl = jnp.asarray(target_lengths, dtype=jnp.int64).reshape(-1)
    return il, tl, s_max


@lowering(aten._ctc_loss, cpu_tensors=True)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """aten::_ctc_loss - (negative log likelihood (N,), log_alpha (N, T, 2 * S + 1)).

    The CTC forward recursion in log space (``lax.scan`` over time). Shapes: log_probs
    (T, N, C); targets (N, S) padded or concatenated 1-D; lengths as int lists or int
    tensors. Impossible alignments give inf (zero_infinity is applied by aten::ctc_loss
    above us). Dtypes: log_probs'. Lengths that do not fit (an input length above T, a
    target length above the targets' width) raise at the op with CPU's text
    (``check_ctc_lengths``). Reference: ATen LossCTC.cpp.
    """
    il, tl, s_max = _ctc_args("aten::_ctc_loss", log_probs, targets, input_lengths, target_lengths)
    check_ctc_lengths(log_probs, targets, input_lengths, target_lengths, blank)
    nll, alpha = _ctc_alpha(log_probs, targets, il, tl, blank, s_max)
    half = _neg(log_probs.dtype) / 2
    nll = jnp.where(nll > -half, jnp.inf, nll).astype(log_probs.dtype)
    alpha = jnp.where(alpha < half, -jnp.inf, alpha).astype(log_probs.dtype)
    return nll, alpha


@lowering(aten._ctc_loss_backward, cpu_tensors=True)
def _ctc_loss_backward(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    neg_log_likelihood,
    log_alpha,
    blank,
    zero_infinity=False,
):
    """aten::_ctc_loss_backward - ATen's CTC gradient w.r.t. log_probs.

    ATen returns (exp(lp) - exp(log(alpha*beta) + nll - lp)) * grad for t < input_length
    (0 after): the true derivative of nll (the second term, here a vjp of the forward
    recursion) plus exp(lp), the softmax term that assumes log_probs came from
    log_softmax. Samples whose nll is inf get NaN for t < input_length, as ATen's; with
    zero_infinity they get 0.
    """
    il, tl, s_max = _ctc_args(
        "aten::_ctc_loss_backward", log_probs, targets, input_lengths, target_lengths
    )

    def nll_of(lp):
        return _ctc_alpha(lp, targets, il, tl, blank, s_max)[0]

    _, pullback = jax.vjp(nll_of, log_probs)
    g = grad.astype(log_probs.dtype).reshape(-1)
    dnll = pullback(g)[0]
    t_mask = (jnp.arange(log_probs.shape[0])[:, None] < il[None, :])[:, :, None]
    out = jnp.where(t_mask, jnp.exp(log_probs) * g[None, :, None] + dnll, 0)
    # An impossible alignment (nll inf): ATen fills the log-gradient with -inf, and
    # exp(-inf + nll - lp) is exp(nan), so every entry with t < input_length is NaN
    # (0 after), unless zero_infinity zeroes the sample (LossCTC.cpp,
    # ctc_loss_backward_cpu_template). The vjp above gives finite garbage there.
    inf = jnp.isinf(neg_log_likelihood)[None, :, None]
    out = jnp.where(inf, 0 if zero_infinity else jnp.where(t_mask, jnp.nan, 0), out)
    return out.astype(log_probs.dtype)


# ---------------------------------------------------------------------------------------
# linear_cross_entropy (chunked): torch_nn custom ops implemented in Python by torch


def _python_impl(op_def):
    def run(args, kwargs):
        return op_def._init_fn(*args, **kwargs)

    run.__doc__ = (
        f"{op_def._qualname} - torch's own Python implementation (chunked matmul + "
        "cross_entropy), run on tpu tensors; its ATen ops reach our lowerings."
    )
    return run


def _register_linear_cross_entropy():
    from torch.nn.modules import linear_cross_entropy as lce

    for name in (
        "_linear_cross_entropy_batch_chunked",
        "_linear_cross_entropy_batch_chunked_no_reduction",
    ):
        op_def = getattr(lce, name, None)
        if op_def is not None:
            handler(op_def._opoverload)(_python_impl(op_def))


_register_linear_cross_entropy()


def _check_nll_arguments(self, target, weight):
    """ATen's argument checks of nll_loss, which the decomposition makes as assertions or
    not at all."""
    if target.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(
            f"expected target dtype to be Long or Byte, but got {aten_type_name(target.dtype)}"
        )
    if weight is None:
        return
    classes = self.shape[1] if self.dim() >= 2 else self.shape[0]
    if weight.numel() != classes:
        if self.dim() == 4:
            raise RuntimeError("weight tensor should be defined either for all or no classes")
        raise RuntimeError(
            f"weight tensor should be defined either for all {classes} classes or no "
            f"classes but got weight tensor of shape: {list(weight.shape)}"
        )
    if weight.dtype != self.dtype:
        raise RuntimeError(
            f"expected scalar type {aten_type_name(self.dtype)} but found "
            f"{aten_type_name(weight.dtype)}"
        )


def _nll_target_check(decomposed, kernel):
    """nll_loss forward through torch's decomposition, after torch's checks: a floating
    input (CPU has no integer, bool or complex kernel; the decomposition would compute),
    and every target (but ``ignore_index``) a class: the decomposition's gather would
    wrap a negative target (a -1 padding label read as the last class) silently."""

    def run(args, kwargs):
        self, target = args[0], args[1]
        if not self.dtype.is_floating_point:
            raise NotImplementedError(
                f"\"{kernel}\" not implemented for '{aten_type_name(self.dtype)}'"
            )
        _check_nll_arguments(self, target, args[2] if len(args) > 2 else kwargs.get("weight"))
        ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
        if isinstance(target, JaxTensor) and target.numel():
            classes = self.shape[1] if self.dim() >= 2 else self.shape[0]
            _check_targets(target, int(ignore), int(classes))
        return decomposed(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=64)
def _target_check(ignore: int, classes: int):
    """The executable checking every target but ``ignore`` is in [0, ``classes``): no
    outputs but its device check (Note [Device-side checks])."""

    def run(t):
        with _checks.collecting() as collected:
            require_in_range(
                jnp.where(t == ignore, 0, t),
                0,
                classes,
                IndexError,
                "Target {value} is out of bounds. (in aten::nll_loss_forward)",
            )
        return (), _checks.outputs(collected)

    return executables.build(run, "nll_loss_target_check")


def _check_targets(target, ignore: int, classes: int) -> None:
    """nll_loss's target check as one executable; in fused eager mode recorded with the
    ops around it, so a loss on a recorded target (a language model's shifted labels)
    does not run the forward's segment (Note [Fused eager])."""
    run = _target_check(ignore, classes)
    if fused.ACTIVE[0]:
        pending = fused_reads.record_read(target)
        if pending is not None:
            dyn = [pending]
            if fused.record(run, dyn) is not fused.NOT_RECORDED:
                return
            _checks.finish(executables.call(run, dyn))  # under a trace: resolved
            return
    _checks.finish(executables.call(run, [target._value()]))


for _nll, _kernel in (
    (aten.nll_loss_forward.default, "nll_loss_out_frame"),
    (aten.nll_loss2d_forward.default, "nll_loss2d_forward_out_frame"),
):
    handler(_nll)(_nll_target_check(decomposition_table[_nll], _kernel))


# Note [ctc_loss with CPU lengths]
# ``aten::ctc_loss.Tensor`` is CompositeImplicitAutograd. For plain tensors it turns the
# length tensors into integer lists and calls the IntList overload (what CUDA users rely
# on: CPU length tensors beside device log-probs); for a tensor subclass it keeps them
# as tensors and divides the device loss by the CPU ``target_lengths`` under "mean",
# which torch refuses as a mixed-device op. Above that decomposition, tpu log-probs with
# CPU lengths take the IntList overload, as plain tensors do (the lengths are host
# values already: nothing is read from the device); other calls decompose as before.
def _ctc_loss_autograd(
    log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False
):
    if input_lengths.device.type == "cpu" and target_lengths.device.type == "cpu":
        return aten.ctc_loss.IntList(
            log_probs,
            targets,
            input_lengths.tolist(),
            target_lengths.tolist(),
            blank,
            reduction,
            zero_infinity,
        )
    return aten.ctc_loss.Tensor.decompose(
        log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity
    )


_CTC_LIB = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
_CTC_LIB.impl("ctc_loss.Tensor", _ctc_loss_autograd)


@handler(aten.ctc_loss.Tensor)
def _ctc_loss_tensor(args, kwargs):
    # Under torch.inference_mode the Autograd keys are skipped and the op reaches
    # __torch_dispatch__ whole: the same rule (Note [ctc_loss with CPU lengths]).
    return _ctc_loss_autograd(*args, **kwargs)


@precheck(aten.soft_margin_loss)
def _soft_margin_loss_dtype(args, kwargs):
    """CPU computes ``log1p(exp(-input * target))`` in place in the input's dtype: an
    integer input refuses the float result (a bool one fails at the negation, as here)."""
    x = arg(args, kwargs, 0, "self")
    if x.dtype != torch.bool:
        check_castable(aten.soft_margin_loss.default, torch.float32, x.dtype)
