"""Eager autograd and optimizers on tpu parameters, step for step against CPU."""

import copy

import pytest
import torch

import torchjax  # noqa: F401


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        torch.nn.SiLU(),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 3),
    )


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (SDPA, causal) and an MLP."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.norm2 = torch.nn.RMSNorm(d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU("tanh"), torch.nn.Linear(4 * d, d)
        )
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.norm2(x))


def _grads_match(cpu_model, tpu_model, tol=1e-5):
    for (name, p_cpu), p_tpu in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        assert p_tpu.grad is not None, name
        assert p_tpu.grad.device.type == "tpu", name
        torch.testing.assert_close(
            p_tpu.grad.cpu(),
            p_cpu.grad,
            rtol=tol,
            atol=tol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("make,shape", [(_mlp, (4, 8)), (Block, (2, 5, 16))])
def test_backward_matches_cpu(make, shape):
    torch.manual_seed(1)
    cpu = make()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(*shape)
    cpu(x).square().mean().backward()
    loss = tpu(x.to("tpu")).square().mean()
    assert loss.requires_grad and loss.grad_fn is not None
    loss.backward()
    _grads_match(cpu, tpu)


@pytest.mark.parametrize(
    "opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    ],
)
def test_optimizer_steps_match_cpu(opt):
    cpu = _mlp()
    tpu = copy.deepcopy(cpu).to("tpu")
    o_cpu, o_tpu = opt(cpu.parameters()), opt(tpu.parameters())
    torch.manual_seed(2)
    x, y = torch.randn(16, 8), torch.randn(16, 3)
    xt, yt = x.to("tpu"), y.to("tpu")
    for _ in range(3):
        o_cpu.zero_grad()
        torch.nn.functional.mse_loss(cpu(x), y).backward()
        o_cpu.step()
        o_tpu.zero_grad()
        torch.nn.functional.mse_loss(tpu(xt), yt).backward()
        o_tpu.step()
    for p_cpu, p_tpu in zip(cpu.parameters(), tpu.parameters()):
        assert p_tpu.device.type == "tpu"
        torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-5)


def test_grad_modes_and_leaves():
    w = torch.randn(3, device="tpu", requires_grad=True)
    assert w.is_leaf and w.requires_grad
    with torch.no_grad():
        y = w * 2
    assert not y.requires_grad
    z = (w * 2).detach()
    assert not z.requires_grad and z.is_leaf
    v = torch.zeros(3, device="tpu").requires_grad_()
    (v + w).sum().backward()
    assert v.grad.tolist() == [1.0, 1.0, 1.0]
    f = torch.ones(2, 2, device="tpu", requires_grad=True)
    assert f.is_leaf and f.grad_fn is None
    (f * f).sum().backward()
    assert f.grad.cpu().tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_grad_accumulates_across_backward_calls():
    w = torch.ones(2, device="tpu", requires_grad=True)
    (w * 3).sum().backward()
    (w * 3).sum().backward()
    assert w.grad.tolist() == [6.0, 6.0]


def test_backward_error_propagates_not_crashes():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom from backward")

    x = torch.ones(2, device="tpu", requires_grad=True)
    with pytest.raises(ValueError, match="boom from backward"):
        Bad.apply(x).sum().backward()
