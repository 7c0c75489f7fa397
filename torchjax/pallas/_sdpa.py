"""``F.scaled_dot_product_attention`` on tpu tensors: the flash kernel where it applies.

Note [SDPA dispatch rule]
``aten::scaled_dot_product_attention`` is CompositeImplicitAutograd; torchjax registers
a kernel for it at ``AutogradPrivateUse1`` here, which takes the flash kernel where
this rule allows, else the math fallback: ``torch.ops.torchjax.exact_attention`` where
the platform's entry in ``MATH_BY_PLATFORM`` says "exact" (TPU) and the call fits it
(Note [SDPA math by platform], torchjax/pallas/_sdpa_math.py), else the fused math of
torchjax/ops/attention.py where Note [Fused SDPA in eager] allows, else the math path
(torch's decomposition); under ``torch.inference_mode``, where the Autograd keys are
skipped, a registry handler calls :func:`scaled_dot_product_attention`, which takes
the flash kernel, the exact op or the math path by the same rules.
The flash kernel (``torch.ops.torchjax.flash_attention``, torchjax/pallas/_flash.py) is
used when all of these hold:

1. the switch is on: ``use_flash_attention(True/False)`` (context manager or plain
   call), else the environment variable ``TORCHJAX_FLASH_ATTENTION`` ("1" on, "0" off),
   else "auto": on when jax's default backend is TPU or GPU (on CPU the kernel would run
   in Pallas interpret mode, much slower than the jnp path);
2. ``dropout_p == 0`` (no dropout in the kernel);
3. q, k, v are 4-D (B, H, S, D) of one dtype in {float32, bfloat16, float16}, k and v of
   the same sequence length, head dim D a power of two in [16, 256] (GPU/TPU tiles);
4. Sq and Sk are multiples of 16 (the smallest block); block sizes come from the
   platform's table (torchjax/pallas/_tiling.py), fitted to Sq and Sk;
5. Hq == Hkv, or ``enable_gqa=True`` with Hq a multiple of Hkv;
6. ``attn_mask`` is None, or a bool/float tensor of rank 2-4 whose last two dims are
   (Sq, Sk) and leading dims 1 or full, not requiring grad; not both a mask and
   ``is_causal`` (torch raises there; the math path raises it).

The decode kernel (``torch.ops.torchjax.decode_attention``, Note [Decode attention] in
torchjax/pallas/_decode.py) is used instead when the switch is on and
:func:`torchjax.pallas.decode_applies` holds: ``dropout_p == 0``, not ``is_causal``; q, k,
v 4-D of one dtype as in 3, ``v`` the shape of ``k``; 1 <= Sq <= 16; Sk a multiple of 16
(and of 128 past 2048); heads as in 5; ``attn_mask`` None, or bool/float of rank 2-4
with last dim Sk, query dim 1 or Sq, head dim 1 or Hq, batch dim 1 or B; no input
requiring grad (the kernel has no backward). That is the call transformers' SDPA
integration makes for a decode step over a static cache: q packed to (B, Hkv, group, D)
(``pack_gqa``), k/v the whole cache, a bool mask (B, 1, 1, S_max). The mask bounds the
key blocks the kernel reads, so the step costs the filled length, not S_max.

The rule reads only shapes, dtypes and flags, never data, so it holds under
``torchjax.jit`` and ``torch.compile``; it is evaluated when a program is traced, so a
switch flipped later does not change already compiled programs.
"""

from __future__ import annotations

import contextvars
import os

import torch

from torchjax.ops.attention import causal_into_mask, fused_sdpa, fused_sdpa_applies, known_mask
from torchjax.ops.attention_checks import cpu_sdpa_checks
from torchjax.ops.registry import handler
from torchjax.pallas._decode_sdpa import decode_applies, decode_sdpa
from torchjax.pallas._flash import flash_attention as _flash_attention
from torchjax.pallas._op import interpret_default, op
from torchjax.pallas._sdpa_math import ContextSwitch, exact_applies, exact_sdpa, math_choice

aten = torch.ops.aten
ENV_VAR = "TORCHJAX_FLASH_ATTENTION"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SWITCH: contextvars.ContextVar = contextvars.ContextVar("torchjax_flash", default=None)


class use_flash_attention(ContextSwitch):
    """Turn the flash kernel for SDPA on (``True``), off (``False``) or back to the
    environment/auto rule (``None``); see Note [SDPA dispatch rule].

    Takes effect at once, for the current thread/context; as a context manager the
    previous setting comes back on exit::

        with torchjax.pallas.use_flash_attention(False):
            out = model(x)      # jnp (math) path

    ``True`` on CPU runs the kernel in Pallas interpret mode (what tests do).
    """

    var = _SWITCH

    def __init__(self, enabled: bool | None = True):
        super().__init__(enabled)


def flash_enabled() -> bool:
    """The switch: context/config, then ``$TORCHJAX_FLASH_ATTENTION``, then auto."""
    value = _SWITCH.get()
    if value is not None:
        return bool(value)
    env = os.environ.get(ENV_VAR, "auto").strip().lower()
    if env in ("0", "false", "off"):
        return False
    if env in ("1", "true", "on"):
        return True
    return not interpret_default()


def flash_applies(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    """Conditions 2-6 of Note [SDPA dispatch rule]: shapes and flags only, not the
    switch (``flash_enabled()``), so True does not mean the kernel runs."""
    if dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return False
    (b, hq, sq, d), (_, hkv, sk, _) = q.shape, k.shape
    if k.shape[0] != b or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        return False
    if d & (d - 1) or not 16 <= d <= 256 or v.shape[-1] != d or sq % 16 or sk % 16:
        return False
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.requires_grad or not 2 <= attn_mask.dim() <= 4:
            return False
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _DTYPES:
            return False
        full = (b, hq, sq, sk)[4 - attn_mask.dim() :]
        if tuple(attn_mask.shape[-2:]) != (sq, sk):
            return False
        if any(m not in (1, f) for m, f in zip(attn_mask.shape[:-2], full[:-2])):
            return False
    return True


@op(
    "torchjax::flash_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, "
    "float? scale=None, int block_q=0, int block_k=0) -> Tensor",
    x64=True,  # the kernels trace in 32-bit mode themselves (Note [A kernel op's JAX mode])
)
def _flash_op(q, k, v, mask=None, causal=False, scale=None, block_q=0, block_k=0):
    # Block size 0: the platform's table (torchjax/pallas/_tiling.py).
    return _flash_attention(
        q, k, v, mask, causal=causal, scale=scale, block_q=block_q or None, block_k=block_k or None
    )


def flash_attention(q, k, v, attn_mask=None, *, is_causal=False, scale=None):
    """The flash kernel on tpu tensors, as ``torch.ops.torchjax.flash_attention``.

    Shapes and semantics as ``F.scaled_dot_product_attention`` with ``dropout_p=0`` and
    GQA by head grouping (see :func:`torchjax.pallas._flash.flash_attention`); blocks from
    the platform's table. Differentiable in q, k, v.
    """
    return _flash_op(q, k, v, attn_mask, is_causal, scale)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """``aten::scaled_dot_product_attention`` on tpu tensors, by Note [SDPA dispatch rule]
    (what CPU's kernel choice refuses refused first: Note [CPU's SDPA kernel choice])."""
    cpu_sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    return _kernel_or_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _kernel_or_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    attn_mask, is_causal = known_mask(query, key, attn_mask, is_causal)
    attn_mask, is_causal = causal_into_mask(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa
    )
    args = (query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if flash_enabled() and decode_applies(*args):
        return decode_sdpa(query, key, value, attn_mask, scale)
    if flash_enabled() and flash_applies(*args):
        return flash_attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale)
    if _exact_math(*args):
        return exact_sdpa(query, key, value, attn_mask, is_causal, scale)
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


@handler(aten.scaled_dot_product_attention.default)
def _sdpa_handler(args, kwargs):
    # Under torch.inference_mode the dispatcher skips the Autograd keys, and with them
    # the AutogradPrivateUse1 kernel: SDPA then reaches JaxTensor.__torch_dispatch__
    # whole (it is not decomposed above the Python key), and the same rule applies here.
    return scaled_dot_product_attention(*args, **kwargs)


def _autograd_kernel(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    # SDPA's own kernel for tpu tensors, above the CompositeImplicitAutograd decomposition.
    cpu_sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    attn_mask, is_causal = known_mask(query, key, attn_mask, is_causal)
    attn_mask, is_causal = causal_into_mask(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa
    )
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kernel = flash_enabled() and (
        decode_applies(*args, enable_gqa) or flash_applies(*args, enable_gqa)
    )
    if not kernel and not _exact_math(*args, enable_gqa) and fused_sdpa_applies(*args, enable_gqa):
        return fused_sdpa(*args, scale, enable_gqa)
    return _kernel_or_math(*args, scale, enable_gqa)


def _exact_math(*args) -> bool:
    # The platform's math fallback (Note [SDPA math by platform]).
    return math_choice() == "exact" and exact_applies(*args)


_LIB = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
_LIB.impl("scaled_dot_product_attention", _autograd_kernel)
