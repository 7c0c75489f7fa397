"""What CPU torch's SDPA refuses before and around its math, for tpu tensors to refuse alike.

Note [CPU's SDPA kernel choice]
For a CPU tensor ``F.scaled_dot_product_attention`` first picks a kernel
(``select_sdp_backend_cpp``, aten/src/ATen/native/transformers/sdp_utils_cpp.cpp): its
flash kernel when every gate passes, else the math path. A tpu tensor always takes the
math path (torch has no kernel choice for PrivateUse1), so what the choice itself does
is ours to repeat, read from CPU torch 2.13's answers:

- the gates, in order, each sending the call to the math path when it fails: dropout_p
  not above 0 (a negative or NaN one passes); q, k, v 4-D; one batch size, and one head
  count (with ``enable_gqa``: k and v one count dividing q's); no empty q, k or v; the
  mask gate; q, k, v of one head dim; a contiguous last dim; a float dtype;
- the mask gate reads the mask's last two sizes, so a mask of rank 0 or 1 raises
  ``IndexError`` there (the math path would broadcast it); a mask requiring grad, or of
  rank 3 or 5 and more, or whose sizes are not (1 or L, 1 or S) and, for rank 4, (1 or
  B, 1 or H), fails it;
- the flash kernel refuses any dropout_p other than 0, so a negative or NaN one raises
  where the gates chose it (the math path ignores a dropout_p that is not above 0).

The math path adds the mask in place into the scores (``attn.add_(attn_mask)``; torch
adds out of place for tensor subclasses, as a tpu tensor is), so a mask that broadcasts
the scores to a larger shape raises there. All of this runs after the arguments'
validation (``validate_sdpa_input``: one dtype, a mask dtype of bool, float or q's, ranks
of 2 and more), which the decomposition makes itself; reading only shapes, dtypes and
flags, it holds under traces too.
"""

from __future__ import annotations

import math

import torch

from torchjax._compat.torch import infer_size

_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _validates(query, key, value, attn_mask) -> bool:
    """Whether ``validate_sdpa_input`` passes (the decomposition raises otherwise)."""
    if not (query.dtype == key.dtype == value.dtype):
        return False
    if min(query.dim(), key.dim(), value.dim()) < 2:
        return False
    return attn_mask is None or attn_mask.dtype in (torch.bool, torch.float32, query.dtype)


def _heads_fit(query, key, value, enable_gqa) -> bool:
    hq, hk, hv = query.size(1), key.size(1), value.size(1)
    if enable_gqa:
        return hk == hv and hk != 0 and hq % hk == 0
    return hq == hk == hv


def _mask_gate(query, key, attn_mask) -> bool:
    if attn_mask is None:
        return True
    if attn_mask.requires_grad:
        return False
    # CPU reads these sizes before it looks at the rank: IndexError below rank 2.
    rows, cols = attn_mask.size(-2), attn_mask.size(-1)
    if rows not in (1, query.size(2)) or cols not in (1, key.size(2)):
        return False
    if attn_mask.dim() == 2:
        return True
    return attn_mask.dim() == 4 and (
        attn_mask.size(0) in (1, query.size(0)) and attn_mask.size(1) in (1, query.size(1))
    )


def cpu_flash_selected(query, key, value, attn_mask, dropout_p, enable_gqa=False) -> bool:
    """Whether CPU torch runs these arguments with its flash kernel (Note [CPU's SDPA
    kernel choice]); raises where its choice raises (a mask of rank below 2)."""
    tensors = (query, key, value)
    if dropout_p > 0.0 or any(t.dim() != 4 for t in tensors):
        return False
    if not (query.size(0) == key.size(0) == value.size(0)):
        return False
    if not _heads_fit(query, key, value, enable_gqa):
        return False
    if any(t.numel() == 0 for t in tensors):
        return False
    if not _mask_gate(query, key, attn_mask):
        return False
    if not (query.size(-1) == key.size(-1) == value.size(-1)):
        return False
    if any(t.stride(-1) != 1 for t in tensors):
        return False
    return query.dtype in _FLASH_DTYPES


def cpu_sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
    """Raise what CPU torch raises for these SDPA arguments where the math path run on
    tpu tensors would not (Note [CPU's SDPA kernel choice])."""
    if not _validates(query, key, value, attn_mask):
        return
    if cpu_flash_selected(query, key, value, attn_mask, dropout_p, enable_gqa):
        if dropout_p != 0.0:
            raise RuntimeError(
                "scaled_dot_product_attention_flash_attention: Currently do not support dropout > 0"
            )
        return
    if attn_mask is not None and not is_causal:
        _check_mask_fits_scores(query, key, attn_mask, enable_gqa)


def _check_mask_fits_scores(query, key, attn_mask, enable_gqa) -> None:
    """The math path's in-place ``attn.add_(attn_mask)``: a mask broadcasting the scores
    (..., L, S) to a larger shape is refused with ``add_``'s text. Shapes that fail
    earlier in the math path (heads, batches) are left to it."""
    q_batch, k_batch = list(query.shape[:-2]), list(key.shape[:-2])
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3:
        if key.size(-3) == 0 or query.size(-3) % key.size(-3):
            return
        k_batch[-1] = q_batch[-1]  # the math path repeats k's heads to q's count
    try:
        batch = infer_size(torch.Size(q_batch), torch.Size(k_batch))
    except RuntimeError:
        return  # the q.k product raises first
    scores = [*batch, query.size(-2), key.size(-2)]
    try:
        full = infer_size(attn_mask.shape, torch.Size(scores))
    except RuntimeError:
        return  # add_ raises its own text (the tpu add raises it too)
    if list(full) != scores:
        raise RuntimeError(
            f"output with shape {scores} doesn't match the broadcast shape {list(full)}"
        )


def math_scale(scale, head_dim: int) -> float:
    """The softmax scale torch's math path uses: ``scale``, else 1/sqrt(E) in double
    (inf for E == 0, where C++'s division gives inf and Python's raises)."""
    if scale is not None:
        return scale
    return 1.0 / math.sqrt(head_dim) if head_dim else math.inf
