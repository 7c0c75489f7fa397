"""``torch.autocast("tpu")``: CUDA's autocast policy on the AutocastPrivateUse1 key.

torch ships autocast kernels for CUDA and CPU in C++; a Python backend gets none, and
without a fallthrough every op under ``torch.autocast("tpu")`` fails with "Could not run
... with arguments from the 'Autocasttpu' backend". So: a fallthrough for every op, and
for the op lists below a kernel that casts floating tensor arguments and redispatches
below the autocast key. The lists and casts follow CUDA's
(``aten/src/ATen/autocast_mode.cpp``): matmul-like ops run in the autocast dtype,
precision-sensitive ops in float32; reductions and scans with a ``dtype`` argument
(``sum``, ``softmax``, ``cumsum``, ...) get ``dtype=torch.float32`` when a floating input
comes without one, ``norm`` computes in float32, and ops that mix their inputs
(``dot``, ``addcmul``, ``index_put``, ...) cast them to the widest floating type among
them and the autocast dtype. float64 tensors are never cast, as on CUDA.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import exclude_dispatch_key

_KEY = "AutocastPrivateUse1"

# aten op names (all overloads) run in the autocast dtype (bfloat16 by default).
LOWER_PRECISION = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "linalg_vecdot",
    "_convolution",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "scaled_dot_product_attention",
)
# aten op names CUDA's autocast refuses outright, with its text.
BANNED = ("binary_cross_entropy",)
_BANNED_TEXT = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
# aten op names run in float32 (lower-precision float inputs are upcast).
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "cross_entropy_loss",
)

# aten op names given dtype=float32 when their first tensor argument is a float other
# than float64 and no dtype is passed (CUDA's fp32_set_opt_dtype).
FP32_SET_OPT_DTYPE = (
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
)
# computed in float32 (CUDA's fp32_append_dtype: the dtype=float variant of the op).
FP32_APPEND_DTYPE = ("norm",)
# floating arguments cast to the widest floating type among them and the autocast dtype.
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "index_put",
    "scatter_add",
    "tensordot",
)

_LIBS: list[torch.library.Library] = []


def _eligible(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(x, dtype):
    if _eligible(x):
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _kernel(op, fixed_dtype):
    def kernel(*args, **kwargs):
        dtype = fixed_dtype or torch.get_autocast_dtype("tpu")
        args = _cast(args, dtype)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with exclude_dispatch_key(_KEY):
            return op(*args, **kwargs)

    return kernel


def _tensors(args, kwargs):
    for x in (*args, *kwargs.values()):
        if isinstance(x, (list, tuple)):
            yield from (y for y in x if isinstance(y, torch.Tensor))
        elif isinstance(x, torch.Tensor):
            yield x


def _set_opt_dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")

    def kernel(*args, **kwargs):
        first = next(_tensors(args, {}), None)
        given = args[at] if len(args) > at else kwargs.get("dtype")
        if _eligible(first) and given is None:
            if len(args) > at:
                args = (*args[:at], torch.float32, *args[at + 1 :])
            else:
                kwargs = {**kwargs, "dtype": torch.float32}
        with exclude_dispatch_key(_KEY):
            return op(*args, **kwargs)

    return kernel


def _append_dtype_kernel(op):
    def kernel(*args, **kwargs):
        if _eligible(args[0]):
            args = (args[0].to(torch.float32), *args[1:])
        with exclude_dispatch_key(_KEY):
            return op(*args, **kwargs)

    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        widest = torch.get_autocast_dtype("tpu")
        for t in _tensors(args, kwargs):
            if _eligible(t):
                widest = torch.promote_types(widest, t.dtype)
        args = _cast(args, widest)
        kwargs = {k: _cast(v, widest) for k, v in kwargs.items()}
        with exclude_dispatch_key(_KEY):
            return op(*args, **kwargs)

    return kernel


def _banned_kernel(op):
    def kernel(*args, **kwargs):
        raise RuntimeError(_BANNED_TEXT)

    return kernel


def register() -> None:
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    impls = torch.library.Library("aten", "IMPL", _KEY)
    policies = (
        (LOWER_PRECISION, lambda op: _kernel(op, None)),
        (FP32, lambda op: _kernel(op, torch.float32)),
        (FP32_SET_OPT_DTYPE, _set_opt_dtype_kernel),
        (FP32_APPEND_DTYPE, _append_dtype_kernel),
        (PROMOTE, _promote_kernel),
        (BANNED, _banned_kernel),
    )
    for names, make in policies:
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                args = op._schema.arguments
                if any(a.alias_info is not None and a.alias_info.is_write for a in args):
                    continue  # out=/in-place: casting would detach the written tensor
                if make is _set_opt_dtype_kernel and "dtype" not in [a.name for a in args]:
                    continue
                if make is _append_dtype_kernel and "dtype" in [a.name for a in args]:
                    continue  # the dtype variants themselves: the caller chose
                suffix = "" if overload == "default" else f".{overload}"
                impls.impl(name + suffix, make(op))
    _LIBS.extend([fallback, impls])
