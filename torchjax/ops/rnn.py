"""Fused LSTM / GRU cells: the pointwise half of ``nn.LSTM``, ``nn.GRU`` and their cells.

For a PrivateUse1 input ATen's RNN code (aten/src/ATen/native/RNN.cpp, ``use_fused_cell``)
computes the gate matmuls itself (``linear``) and hands the rest to
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, the ops CUDA implements in
aten/src/ATen/native/cuda/RNN.cu; autograd then calls ``_thnn_fused_lstm_cell_backward_impl``
(under ``_thnn_fused_lstm_cell_backward``, CompositeImplicitAutograd) and
``_thnn_fused_gru_cell_backward``, which read what the forward saved in its ``workspace``.
We reproduce the CUDA kernels: same formulas, same workspace layout, so a workspace made
by one implementation is read correctly by the other's backward. ``nn.RNN`` (tanh/relu)
has no fused cell: it decomposes to matmuls and pointwise ops.

Note [RNN cell workspace]
    LSTM: ``(batch, 4 * hidden)`` = cat([i, f, g, o], 1), the gate activations
    (sigmoid, sigmoid, tanh, sigmoid), in the gate order of ``weight_ih``.
    GRU: ``(batch, 5 * hidden)`` = cat([r, z, n, hx, hn + b_hn], 1): reset and update gates
    (sigmoid), the new gate (tanh), the previous hidden state, and the hidden half of the
    new gate's pre-activation with its bias (the backward needs it for the reset gate).

Dtypes: float16/bfloat16 are computed in float32 and every output cast back (CUDA's
``accscalar_t``), so the workspace holds rounded activations, as on CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchjax.ops.registry import Kind, handler, lowering

aten = torch.ops.aten


def _check_gates(op, input_gates, hidden_gates, input_bias, hidden_bias, hx, factor):
    """ATen's checkSizes: gates (batch, factor * hidden), biases (factor * hidden,)."""
    batch, hidden = hx.shape if hx.ndim == 2 else (None, None)
    want = (batch, factor * hidden) if hidden is not None else None
    for name, t in (("input_gates", input_gates), ("hidden_gates", hidden_gates)):
        if want is None or t.shape != want:
            raise RuntimeError(
                f"aten::{op}: expected {name} of shape {want} (batch, {factor} * hidden_size) "
                f"for a hidden state of shape {tuple(hx.shape)}, got {tuple(t.shape)}"
            )
    if (input_bias is None) != (hidden_bias is None):
        raise RuntimeError(
            f"aten::{op}: input_bias and hidden_bias must both be given or both None"
        )
    for name, b in (("input_bias", input_bias), ("hidden_bias", hidden_bias)):
        if b is not None and b.shape != (factor * hidden,):
            raise RuntimeError(
                f"aten::{op}: expected {name} of shape ({factor * hidden},), got {tuple(b.shape)}"
            )


def _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias, count):
    """Per-gate (input part, hidden part) pre-activations, biases added."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    return jnp.split(input_gates, count, axis=1), jnp.split(hidden_gates, count, axis=1)


def _sigmoid_grad(grad, y):
    return grad * (1 - y) * y


def _tanh_grad(grad, y):
    return grad * (1 - y * y)


@lowering(aten._thnn_fused_lstm_cell, promote=Kind.DEFAULT)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """aten::_thnn_fused_lstm_cell - the LSTM cell after its two matmuls.

    Shapes: input_gates, hidden_gates (batch, 4 * hidden) in gate order i, f, g, o; cx
    (batch, hidden); optional biases (4 * hidden,), both or neither. Returns
    (hy, cy, workspace) with workspace (batch, 4 * hidden), see Note [RNN cell workspace].
    Dtypes: floating; f16/bf16 computed in float32, outputs cast back.
    Reference: lstm_cell_forward in aten/src/ATen/native/cuda/RNN.cu.
    """
    op = "_thnn_fused_lstm_cell"
    _check_gates(op, input_gates, hidden_gates, input_bias, hidden_bias, cx, 4)
    xs, hs = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias, 4)
    i = jax.nn.sigmoid(xs[0] + hs[0])
    f = jax.nn.sigmoid(xs[1] + hs[1])
    g = jnp.tanh(xs[2] + hs[2])
    o = jax.nn.sigmoid(xs[3] + hs[3])
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lowering(aten._thnn_fused_lstm_cell_backward_impl, promote=Kind.DEFAULT)
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """aten::_thnn_fused_lstm_cell_backward_impl - gradients of the fused LSTM cell.

    Shapes: grad_hy, grad_cy (batch, hidden), either may be None (a zero gradient); cx, cy
    (batch, hidden); workspace as the forward made it (Note [RNN cell workspace]). Returns
    (grad_gates (batch, 4 * hidden), grad_cx, grad_bias (4 * hidden,) or None when not
    ``has_bias``); all three None when both incoming gradients are None, as ATen returns
    undefined tensors. grad_gates serves both the input and the hidden gates.
    Dtypes: floating; f16/bf16 computed in float32, outputs cast back.
    Reference: lstm_cell_backward in aten/src/ATen/native/cuda/RNN.cu.
    """
    if grad_hy is None and grad_cy is None:
        return None, None, None
    op = "_thnn_fused_lstm_cell_backward_impl"
    for name, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cy", cy)):
        if t is not None and t.shape != cx.shape:
            raise RuntimeError(f"aten::{op}: expected {name} of shape {cx.shape}, got {t.shape}")
    if workspace.shape != (cx.shape[0], 4 * cx.shape[1]):
        raise RuntimeError(
            f"aten::{op}: expected workspace of shape {(cx.shape[0], 4 * cx.shape[1])}, "
            f"got {workspace.shape}"
        )
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    zero = jnp.zeros(cx.shape, dtype=cx.dtype)
    go = zero if grad_hy is None else grad_hy
    gc = go * o * (1 - tanh_cy * tanh_cy) + (zero if grad_cy is None else grad_cy)
    grad_gates = jnp.concatenate(
        [
            _sigmoid_grad(gc * g, i),
            _sigmoid_grad(gc * cx, f),
            _tanh_grad(gc * i, g),
            _sigmoid_grad(go * tanh_cy, o),
        ],
        axis=1,
    )
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else None
    return grad_gates, gc * f, grad_bias


@lowering(aten._thnn_fused_gru_cell, promote=Kind.DEFAULT)
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """aten::_thnn_fused_gru_cell - the GRU cell after its two matmuls.

    Shapes: input_gates, hidden_gates (batch, 3 * hidden) in gate order r, z, n; hx
    (batch, hidden); optional biases (3 * hidden,), both or neither. Returns (hy, workspace)
    with workspace (batch, 5 * hidden), see Note [RNN cell workspace]. The hidden bias of
    the new gate sits inside the reset gate's product, so biases are not simply summed.
    Dtypes: floating; f16/bf16 computed in float32, outputs cast back.
    Reference: gru_cell_forward in aten/src/ATen/native/cuda/RNN.cu.
    """
    _check_gates("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, hx, 3)
    xs, hs = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias, 3)
    r = jax.nn.sigmoid(xs[0] + hs[0])
    z = jax.nn.sigmoid(xs[1] + hs[1])
    n = jnp.tanh(xs[2] + r * hs[2])
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, hs[2]], axis=1)


@lowering(aten._thnn_fused_gru_cell_backward, promote=Kind.DEFAULT)
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """aten::_thnn_fused_gru_cell_backward - gradients of the fused GRU cell.

    Shapes: grad_hy (batch, hidden); workspace (batch, 5 * hidden) as the forward made it.
    Returns (grad_input_gates, grad_hidden_gates (batch, 3 * hidden), grad_hx, and when
    ``has_bias`` their column sums as grad_input_bias, grad_hidden_bias (3 * hidden,), else
    None). The gates' gradients differ only in the new gate (the hidden part is scaled by
    the reset gate). Dtypes: floating; f16/bf16 computed in float32, outputs cast back.
    Reference: gru_cell_backward in aten/src/ATen/native/cuda/RNN.cu.
    """
    if grad_hy.ndim != 2 or workspace.shape != (grad_hy.shape[0], 5 * grad_hy.shape[1]):
        raise RuntimeError(
            f"aten::_thnn_fused_gru_cell_backward: expected a 2-d grad_hy and a workspace of "
            f"shape (batch, 5 * hidden), got grad_hy {grad_hy.shape}, workspace {workspace.shape}"
        )
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    gz = _sigmoid_grad(grad_hy * (hx - n), z)
    gn = _tanh_grad(grad_hy * (1 - z), n)
    gr = _sigmoid_grad(gn * hn, r)
    grad_input_gates = jnp.concatenate([gr, gz, gn], axis=1)
    grad_hidden_gates = jnp.concatenate([gr, gz, gn * r], axis=1)
    grad_hx = grad_hy * z
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, None, None
    return (
        grad_input_gates,
        grad_hidden_gates,
        grad_hx,
        jnp.sum(grad_input_gates, axis=0),
        jnp.sum(grad_hidden_gates, axis=0),
    )


# ---------------------------------------------------------------------------------------
# packed sequences


@handler(aten._pack_padded_sequence.default)
def _pack_padded_sequence(args, kwargs):
    """aten::_pack_padded_sequence - the valid time steps of a padded batch, step after
    step, and how many sequences each step holds (``pack_padded_sequence``).

    Shapes: input (T, B, *) or (B, T, *) with ``batch_first``; lengths (B,), a CPU int64
    tensor sorted in decreasing order -> (data (sum(lengths), *), batch_sizes
    (lengths[0],) on CPU). Written as ATen's CompositeExplicit kernel
    (PackedSequence.cpp): slices of the input concatenated, with its checks and messages.
    The lengths are host data, so nothing is read from the device."""
    names = ("input", "lengths", "batch_first")
    bound = dict(zip(names, args), **kwargs)
    inp, lengths_t, batch_first = bound["input"], bound["lengths"], bound["batch_first"]
    if lengths_t.device.type != "cpu" or lengths_t.dim() != 1 or lengths_t.dtype != torch.int64:
        raise RuntimeError(
            "'lengths' argument should be a 1D CPU int64 tensor, but got "
            f"{lengths_t.dim()}D {lengths_t.device} {lengths_t.dtype} tensor"
        )
    x = inp.transpose(0, 1) if batch_first else inp
    batch = x.size(1)
    lengths = lengths_t.tolist()
    if x.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    if len(lengths) != batch:
        raise RuntimeError(
            f"Expected `len(lengths)` to be equal to batch_size, but got {len(lengths)} "
            f"(batch_size={batch})"
        )
    if lengths[-1] <= 0:
        raise RuntimeError(
            "Length of all samples has to be greater than 0, but found an element in "
            "'lengths' that is <= 0"
        )
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise RuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is "
            "True. You can pass `enforce_sorted=False` to pack_padded_sequence and/or "
            "pack_sequence to sidestep this requirement if you do not need ONNX "
            "exportability."
        )
    steps, batch_sizes, prev = [], [], 0
    step_shape = [-1, *x.shape[2:]]
    for i in range(batch):
        length = lengths[batch - 1 - i]
        if length > prev:
            current = batch - i
            piece = aten.slice.Tensor(aten.slice.Tensor(x, 0, prev, length), 1, 0, current)
            steps.append(
                aten.view.default(
                    aten.clone.default(piece, memory_format=torch.contiguous_format), step_shape
                )
            )
            batch_sizes.extend([current] * (length - prev))
            prev = length
    return aten.cat.default(steps), torch.tensor(batch_sizes, dtype=torch.int64)
