"""The kernels, as torch operators (``torch.ops.tpu_layers.*``).

RMSNorm and SiLU-and-mul are row-blocked Pallas kernels (compiled on TPU, interpret mode
on CPU); their backward is ``jax.vjp`` of the jnp reference (a ``jax.custom_vjp``).
Numerics follow transformers' layers: statistics in float32, the normalised rows cast
back to the input dtype before the weight multiplies them.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.experimental import pallas as pl

import torchjax.pallas as tp

# Traces of each kernel (eager: once per new shape; under jit: once per program), so a
# caller can see that the kernel, not the layer's own forward, ran.
CALLS = collections.Counter()


def _rows(n: int) -> int:
    return next((b for b in (256, 128, 64, 32, 16, 8) if n % b == 0), n)


def _row_blocked(kernel, x2d, extra, out_cols, out_dtype, name):
    n, h = x2d.shape
    block = _rows(n)
    return pl.pallas_call(
        kernel,
        grid=(n // block,),
        in_specs=[pl.BlockSpec((block, h), lambda i: (i, 0))]
        + [pl.BlockSpec(a.shape, lambda i: (0, 0)) for a in extra],
        out_specs=pl.BlockSpec((block, out_cols), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, out_cols), out_dtype),
        interpret=tp.interpret_default(),
        name=name,
    )(x2d, *extra)


# -- RMSNorm --------------------------------------------------------------------------


def rms_norm_reference(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _rms_kernel(x_ref, w_ref, o_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    normed = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (w_ref[...] * normed.astype(x_ref.dtype)).astype(o_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, eps):
    CALLS["rms_norm"] += 1
    h = x.shape[-1]
    out_dtype = jnp.result_type(weight, x)
    out = _row_blocked(
        functools.partial(_rms_kernel, eps=eps),
        x.reshape(-1, h),
        [weight.reshape(1, h)],
        h,
        out_dtype,
        "tpu_layers_rms_norm",
    )
    return out.reshape(x.shape)


def _rms_fwd(x, weight, eps):
    return _rms_norm(x, weight, eps), (x, weight)


def _rms_bwd(eps, res, g):
    _, pull = jax.vjp(lambda x, w: rms_norm_reference(x, w, eps), *res)
    return pull(g)


_rms_norm.defvjp(_rms_fwd, _rms_bwd)


@tp.op("tpu_layers::rms_norm")
def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm over the last dim of ``x`` (..., H) with ``weight`` (H,)."""
    return _rms_norm(x, weight, eps)


# -- SiLU and mul ---------------------------------------------------------------------


def silu_and_mul_reference(x):
    gate, up = jnp.split(x, 2, axis=-1)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up


def _silu_mul_kernel(x_ref, o_ref):
    d = o_ref.shape[-1]
    x = x_ref[...]
    gate = x[:, :d].astype(jnp.float32)
    o_ref[...] = (gate * jax.nn.sigmoid(gate)).astype(x.dtype) * x[:, d:]


@jax.custom_vjp
def _silu_and_mul(x):
    CALLS["silu_and_mul"] += 1
    d = x.shape[-1] // 2
    out = _row_blocked(
        _silu_mul_kernel, x.reshape(-1, 2 * d), [], d, x.dtype, "tpu_layers_silu_and_mul"
    )
    return out.reshape(*x.shape[:-1], d)


def _silu_fwd(x):
    return _silu_and_mul(x), x


def _silu_bwd(x, g):
    return jax.vjp(silu_and_mul_reference, x)[1](g)


_silu_and_mul.defvjp(_silu_fwd, _silu_bwd)


@tp.op("tpu_layers::silu_and_mul")
def silu_and_mul(x):
    """``silu(x[..., :d]) * x[..., d:]``, ``d = x.shape[-1] // 2`` (last dim even)."""
    return _silu_and_mul(x)


# -- MoE experts ----------------------------------------------------------------------


@tp.op("tpu_layers::experts")
def experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """SwiGLU experts: (T, H) tokens, (T, k) expert ids and weights, ``gate_up_proj``
    (E, 2I, H) and ``down_proj`` (E, H, I) (``nn.Linear`` layout) -> (T, H).

    Token-expert pairs are sorted by expert and go through two Pallas ragged dots
    (``torchjax.pallas.kernels.ragged_dot``); top-k is summed in float32.
    """
    CALLS["experts"] += 1
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.sum(flat[:, None] == jnp.arange(num_experts), axis=0)
    x = hidden_states[order // top_k].astype(gate_up_proj.dtype)
    h = tp.kernels.ragged_dot(x, gate_up_proj, group_sizes, transpose_rhs=True)
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(h.dtype) * up
    out = tp.kernels.ragged_dot(
        act.astype(down_proj.dtype), down_proj, group_sizes, transpose_rhs=True
    )
    out = out * top_k_weights.reshape(-1)[order][:, None].astype(out.dtype)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    summed = unsorted.reshape(num_tokens, top_k, hidden).astype(jnp.float32).sum(axis=1)
    return summed.astype(hidden_states.dtype)


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers ``ExpertsInterface`` forward for concatenated gate/up SiLU experts
    (Qwen3-MoE, Mixtral, ...): ``ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)``."""
    act = getattr(self.config, "hidden_act", None)
    if not self.has_gate or self.has_bias or self.is_transposed or act != "silu":
        raise NotImplementedError(
            "tpu_layers.experts_forward: supports gated, bias-free, untransposed SiLU "
            f"experts; got has_gate={self.has_gate}, has_bias={self.has_bias}, "
            f"is_transposed={self.is_transposed}, hidden_act={act!r}. Use another "
            "experts_implementation for this model."
        )
    # torch.ops.* (not the op object): stays in a torch.compile graph (see layers.py).
    return torch.ops.tpu_layers.experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj
    )
