"""``torch.autocast("tpu")``: CUDA's autocast policy on the AutocastPrivateUse1 key.

torch ships autocast kernels for CUDA and CPU in C++; a Python backend gets none, and
without a fallthrough every op under ``torch.autocast("tpu")`` fails with "Could not run
... with arguments from the 'Autocasttpu' backend". So: a fallthrough for every op, and
for the op lists below a kernel that casts floating tensor arguments and redispatches
below the autocast key. The lists follow CUDA's (``aten/src/ATen/autocast_mode.cpp``):
matmul-like ops run in the autocast dtype, precision-sensitive ops in float32.
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
    "scaled_dot_product_attention",
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

_LIBS: list[torch.library.Library] = []


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
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


def register() -> None:
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    impls = torch.library.Library("aten", "IMPL", _KEY)
    for names, dtype in ((LOWER_PRECISION, None), (FP32, torch.float32)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if any(
                    a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
                ):
                    continue  # out=/in-place: casting would detach the written tensor
                suffix = "" if overload == "default" else f".{overload}"
                impls.impl(name + suffix, _kernel(op, dtype))
    _LIBS.extend([fallback, impls])
