"""Linalg results as CPU's kernels give them: their strides (Note [LAPACK's column-major
results]) and their refusals (Note [Linalg refusals in CPU's words])."""

from __future__ import annotations

import torch

from torchjax.ops import layouts, out_refusals
from torchjax.tensor._storage import contiguous_strides
from torchjax.tensor._tensor import JaxTensor

# Note [LAPACK's column-major results]
# LAPACK works on column-major (Fortran-order) matrices, and ATen's CPU kernels allocate
# their results that way so that LAPACK writes them in place: ``torch.linalg.inv(a)``
# of a 4 x 4 ``a`` has strides (1, 4), a batch (3, 4, 4) has (16, 1, 4), as do Q and R of
# ``linalg.qr``, U and Vh of ``linalg.svd``, eigenvectors, Cholesky and LU factors and
# the solutions of the solvers (vectors, pivots, eigen- and singular values are
# contiguous). Code sees it: ``.is_contiguous()`` is False, ``.view(-1)`` raises, and
# ``x.mT`` is contiguous. Each op here takes the strides of its meta kernel's result,
# which are CPU's, except where the meta kernel has none (``geqrf``, ``linalg_lstsq``) or
# gives other ones (``_linalg_svd``'s Vh and ``linalg_eig``'s vectors, which CPU makes
# column-major and meta row-major): those results are laid out column-major by rule
# (ATen's ``batched_matrix_contiguous_strides``). The values are those computed; the
# result reports the strides and its storage is the value in that memory order, made on
# first read (ops/layouts.py's ``apply_layout``). An out= tensor that CPU resizes takes
# the result's strides too (``RESIZED_AS_RESULT`` in ops/writeback.py).


# Note [Linalg refusals in CPU's words]
# The meta kernels of the linalg ops are Python (torch/_meta_registrations.py), and their
# checks word refusals their own way: "linalg.inv_ex: The input tensor must have at
# least 2 dimensions, got 1" as an AssertionError, "Got torch.int64" for CPU's "Got
# Long", where CPU's kernel raises RuntimeError("linalg.inv: The input tensor A must have
# at least 2 dimensions."). So a call the meta kernel refuses is made again on CPU, on
# zeros of the arguments' shapes and dtypes (ops/out_refusals.py's ``cpu_answer``; the
# refusal path only), and CPU's exception is raised, the overload appended. A numerical
# failure CPU meets on the zeros instead (LinAlgError: CPU accepted the call's shapes
# and dtypes) or no CPU kernel leaves the meta kernel's refusal. The ops without a meta
# kernel (geqrf, linalg_lstsq) do the same when their lowering fails.
CHECK_ERRORS = (RuntimeError, AssertionError, TypeError, ValueError, IndexError, KeyError)


def raise_cpus_refusal(func, args, kwargs) -> None:
    """Raise CPU's exception for a call refused here, if CPU refuses it (see the Note)."""
    cpu = out_refusals.cpu_answer(func, args, kwargs, ())
    if isinstance(cpu, Exception) and not isinstance(cpu, torch.linalg.LinAlgError):
        raise out_refusals.in_cpus_words(cpu, func) from None


def column_major_plan(size) -> tuple | None:
    """``layouts.strides_for``'s plan for a batch of column-major matrices of ``size``."""
    if len(size) < 2:
        return None
    stride = list(contiguous_strides(size))
    stride[-1], stride[-2] = max(size[-2], 1), 1
    return layouts.strides_for(torch.empty_strided(size, stride, device="meta"))


def cpu_layout(result, metas, column_major):
    """``result`` (the lowering's fresh results) at CPU's strides (see the Note)."""
    many = isinstance(result, (list, tuple))
    results = result if many else (result,)
    if metas is None:
        metas = (None,) * len(results)
    elif not isinstance(metas, (list, tuple)):
        metas = (metas,)
    laid = []
    for i, (r, m) in enumerate(zip(results, metas)):
        if isinstance(r, JaxTensor):
            plan = column_major_plan(r._size) if i in column_major else layouts.strides_for(m)
            r = layouts.apply_layout(r, plan)
        laid.append(r)
    return type(result)(laid) if many else laid[0]
