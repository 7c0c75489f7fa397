"""Tests for torchjax/ops/rnn.py: nn.LSTM / GRU / RNN and their cells against CPU torch.

op_db has no OpInfo for the RNN modules or the fused cells, so the tests are direct: the
same module (copy.deepcopy) on CPU and on tpu, comparing outputs, final states and the
gradients of every parameter and input.
"""

import copy

import pytest
import torch

import torchjax  # noqa: F401

aten = torch.ops.aten
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-7, atol=1e-7)}


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in x for t in _flat(y)]


def _compare(module, inputs, dtype=torch.float32):
    """Run ``module(*inputs)`` on CPU and tpu; compare outputs and all gradients."""
    torch.manual_seed(0)
    cpu_mod = module.to(dtype)
    tpu_mod = copy.deepcopy(cpu_mod).to("tpu")
    cpu_in = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
    tpu_in = [x.detach().to("tpu").requires_grad_() for x in cpu_in]
    want = _flat(cpu_mod(*cpu_in))
    got = _flat(tpu_mod(*tpu_in))
    weights = [torch.randn_like(w) for w in want]
    sum(((w * c).sum() for w, c in zip(weights, want))).backward()
    sum(((w.to("tpu") * g).sum() for w, g in zip(weights, got))).backward()
    tol = TOL[dtype]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device.type == "tpu"
        torch.testing.assert_close(g.cpu(), w.detach(), **tol)
    for (name, p), q in zip(cpu_mod.named_parameters(), tpu_mod.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name, **tol)
    for c, t in zip(cpu_in, tpu_in):
        torch.testing.assert_close(t.grad.cpu(), c.grad, **tol)


LSTM_GRU_CASES = [
    # num_layers, bidirectional, batch_first, bias, initial state
    (1, False, False, True, False),
    (2, True, False, True, True),
    (2, False, True, False, True),
    (1, True, True, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("layers,bidir,batch_first,bias,with_state", LSTM_GRU_CASES)
def test_lstm_gru(cls, layers, bidir, batch_first, bias, with_state, dtype):
    torch.manual_seed(0)
    module = cls(3, 5, num_layers=layers, bidirectional=bidir, batch_first=batch_first, bias=bias)
    seq, batch = 4, 2
    x = torch.randn((batch, seq, 3) if batch_first else (seq, batch, 3))
    inputs = [x]
    if with_state:
        h0 = torch.randn(layers * (2 if bidir else 1), batch, 5)
        inputs.append((h0, torch.randn_like(h0)) if cls is torch.nn.LSTM else h0)
    if cls is torch.nn.LSTM and with_state:
        # nn.LSTM takes the (h0, c0) tuple: flatten it so both get gradients.
        h0, c0 = inputs.pop()
        _compare(_LSTMWithState(module), [x, h0, c0], dtype)
    else:
        _compare(module, inputs, dtype)


class _LSTMWithState(torch.nn.Module):
    def __init__(self, lstm):
        super().__init__()
        self.lstm = lstm

    def forward(self, x, h0, c0):
        return self.lstm(x, (h0, c0))


@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_lstm_proj_size_and_unbatched():
    torch.manual_seed(0)
    _compare(
        torch.nn.LSTM(3, 6, num_layers=2, proj_size=4, bidirectional=True), [torch.randn(4, 2, 3)]
    )
    _compare(torch.nn.GRU(3, 5, num_layers=2), [torch.randn(4, 3)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell(bias, dtype):
    torch.manual_seed(0)
    x, h, c = torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)
    _compare(_LSTMCellWithState(torch.nn.LSTMCell(4, 6, bias=bias)), [x, h, c], dtype)
    _compare(torch.nn.LSTMCell(4, 6, bias=bias), [x], dtype)


class _LSTMCellWithState(torch.nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x, h, c):
        return self.cell(x, (h, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell(bias, dtype):
    torch.manual_seed(0)
    x, h = torch.randn(3, 4), torch.randn(3, 6)
    _compare(torch.nn.GRUCell(4, 6, bias=bias), [x, h], dtype)
    _compare(torch.nn.GRUCell(4, 6, bias=bias), [torch.randn(4)], dtype)


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn(nonlinearity):
    torch.manual_seed(0)
    rnn = torch.nn.RNN(3, 5, num_layers=2, nonlinearity=nonlinearity, bidirectional=True)
    _compare(rnn, [torch.randn(4, 2, 3), torch.randn(4, 2, 5)])
    _compare(torch.nn.RNNCell(3, 5, nonlinearity=nonlinearity), [torch.randn(2, 3)])


def test_lstm_only_cell_state_used():
    # Only c_n reaches the loss: the backward gets grad_hy None for the last step.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    tpu = copy.deepcopy(lstm).to("tpu")
    x = torch.randn(3, 2, 3)
    lstm(x)[1][1].sum().backward()
    tpu(x.to("tpu"))[1][1].sum().backward()
    for p, q in zip(lstm.parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)


def test_lstm_cell_double_backward():
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(3, 4)
    tpu = copy.deepcopy(cell).to("tpu")
    x = torch.randn(2, 3)
    results = []
    for m, xi in ((cell, x.clone().requires_grad_()), (tpu, x.to("tpu").requires_grad_())):
        hy, cy = m(xi)
        (g,) = torch.autograd.grad((hy * cy).sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), xi)
        results.append((g.detach().cpu(), gg.cpu()))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# the fused ops directly (CPU has no kernel for them: compare with their formulas)


def _lstm_reference(gi, gh, cx, bi, bh):
    i, f, g, o = (gi + bi + gh + bh).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def test_fused_lstm_cell_workspace_and_backward_impl():
    torch.manual_seed(0)
    gi, gh, bi, bh = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    cx, ghy, gcy = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2)
    t = [a.to("tpu") for a in (gi, gh, cx, bi, bh)]
    hy, cy, ws = aten._thnn_fused_lstm_cell(*t)
    want = _lstm_reference(gi, gh, cx, bi, bh)
    for g, w in zip((hy, cy, ws), want):
        torch.testing.assert_close(g.cpu(), w)
    # backward_impl against autograd of the reference, with either incoming gradient absent.
    for grads in ((ghy, gcy), (ghy, None), (None, gcy)):
        leaves = [a.clone().requires_grad_() for a in (gi, cx, bi)]
        ref = _lstm_reference(leaves[0], gh, leaves[1], leaves[2], bh)
        outs = [(o * g).sum() for o, g in zip(ref[:2], grads) if g is not None]
        sum(outs).backward()
        tg = [None if g is None else g.to("tpu") for g in grads]
        got = aten._thnn_fused_lstm_cell_backward_impl(*tg, cx.to("tpu"), cy, ws, True)
        for g, leaf in zip(got, leaves):
            torch.testing.assert_close(g.cpu(), leaf.grad)
    assert aten._thnn_fused_lstm_cell_backward_impl(None, None, t[2], cy, ws, True) == (
        None,
        None,
        None,
    )
    assert (
        aten._thnn_fused_lstm_cell_backward_impl(ghy.to("tpu"), None, t[2], cy, ws, False)[2]
        is None
    )


def test_fused_gru_cell_workspace_and_backward():
    torch.manual_seed(0)
    gi, gh, bi, bh = torch.randn(3, 6), torch.randn(3, 6), torch.randn(6), torch.randn(6)
    hx, ghy = torch.randn(3, 2), torch.randn(3, 2)
    leaves = [a.clone().requires_grad_() for a in (gi, gh, hx, bi, bh)]
    (xr, xz, xn), (hr, hz, hn) = (
        (leaves[0] + leaves[3]).chunk(3, 1),
        (leaves[1] + leaves[4]).chunk(3, 1),
    )
    r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
    n = (xn + r * hn).tanh()
    want_hy = n + z * (leaves[2] - n)
    (want_hy * ghy).sum().backward()
    hy, ws = aten._thnn_fused_gru_cell(*(a.to("tpu") for a in (gi, gh, hx, bi, bh)))
    torch.testing.assert_close(hy.cpu(), want_hy.detach())
    torch.testing.assert_close(ws.cpu(), torch.cat([r, z, n, hx, hn], 1).detach())
    got = aten._thnn_fused_gru_cell_backward(ghy.to("tpu"), ws, True)
    for g, leaf in zip(got, leaves):
        torch.testing.assert_close(g.cpu(), leaf.grad)
    assert aten._thnn_fused_gru_cell_backward(ghy.to("tpu"), ws, False)[3:] == (None, None)


def test_fused_cells_half_precision():
    torch.manual_seed(0)
    gi, gh, cx = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 2)
    for dtype in (torch.float16, torch.bfloat16):
        hy, cy, ws = aten._thnn_fused_lstm_cell(*(a.to(dtype).to("tpu") for a in (gi, gh, cx)))
        want = _lstm_reference(*(a.to(dtype).float() for a in (gi, gh, cx)), 0, 0)
        for g, w in zip((hy, cy, ws), want):
            assert g.dtype == dtype
            torch.testing.assert_close(g.cpu(), w.to(dtype))


def test_fused_cell_shape_errors():
    gi, cx = torch.randn(3, 8, device="tpu"), torch.randn(3, 3, device="tpu")
    with pytest.raises(RuntimeError, match="aten::_thnn_fused_lstm_cell"):
        aten._thnn_fused_lstm_cell(gi, gi, cx)
    with pytest.raises(RuntimeError, match="aten::_thnn_fused_gru_cell.*input_bias"):
        aten._thnn_fused_gru_cell(gi[:, :6], gi[:, :6], cx[:, :2], torch.randn(6, device="tpu"))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequences_through_an_lstm_as_cpu(batch_first, enforce_sorted):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    x = torch.randn(3, 5, 2) if batch_first else torch.randn(5, 3, 2)
    lengths = torch.tensor([5, 3, 2] if enforce_sorted else [2, 5, 3])
    lstm = torch.nn.LSTM(2, 4, num_layers=2, batch_first=batch_first)
    results = []
    for device in ("cpu", "tpu"):
        inp = x.clone().to(device).requires_grad_()
        packed = pack_padded_sequence(inp, lengths, batch_first, enforce_sorted)
        out, _ = copy.deepcopy(lstm).to(device)(packed)
        padded, sizes = pad_packed_sequence(out, batch_first=batch_first)
        padded.sum().backward()
        results.append((packed.data, packed.batch_sizes, padded, sizes, inp.grad))
    (cpu_data, cpu_bs, cpu_out, cpu_sizes, cpu_grad), (data, bs, out, sizes, grad) = results
    assert torch.equal(data.cpu(), cpu_data)
    assert bs.device.type == "cpu" and torch.equal(bs, cpu_bs) and torch.equal(sizes, cpu_sizes)
    torch.testing.assert_close(out.cpu(), cpu_out)
    torch.testing.assert_close(grad.cpu(), cpu_grad)


def test_pack_padded_sequence_refuses_unsorted_lengths_as_cpu():
    from torch.nn.utils.rnn import pack_padded_sequence

    for x in (torch.randn(3, 5, 2), torch.randn(3, 5, 2).to("tpu")):
        with pytest.raises(RuntimeError, match="must be sorted in decreasing order"):
            pack_padded_sequence(x, torch.tensor([2, 5, 3]), batch_first=True)
