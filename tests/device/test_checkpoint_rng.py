"""torch.utils.checkpoint replays the tpu RNG state, so recomputed dropout masks match.

Both checkpoint implementations stash the device RNG state through the device module
(``torch.tpu._initialized``, ``get_rng_state``/``set_rng_state`` under ``fork_rng``); the
recomputation must draw the masks of the forward, as on CPU.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.lin2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.lin2(self.drop(torch.relu(self.lin1(x))))


def _grads(device, checkpointed, use_reentrant, seed=1):
    """Gradients of x and every parameter, and a draw made after backward."""
    torch.manual_seed(0)
    block = _Block().to(device)
    x = torch.randn(4, 8).to(device).requires_grad_()
    torch.manual_seed(seed)
    if checkpointed:
        y = checkpoint(block, x, use_reentrant=use_reentrant)
    else:
        y = block(x)
    y.square().sum().backward()
    after = torch.rand(3, device=device)
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return [g.cpu() for g in grads], after.cpu()


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_dropout_gradients_equal_plain_run(device, use_reentrant):
    plain, plain_after = _grads(device, False, use_reentrant)
    ckpt, ckpt_after = _grads(device, True, use_reentrant)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # The RNG stream continues as without checkpointing (fork_rng restores it).
    assert torch.equal(ckpt_after, plain_after)
    # The masks are random: another seed gives other gradients.
    other, _ = _grads(device, False, use_reentrant, seed=2)
    assert not torch.equal(other[0], plain[0])


def test_checkpoint_stashes_tpu_state():
    from torch.utils.checkpoint import _get_device_module, get_device_states

    assert _get_device_module("tpu") is torch.tpu
    assert torch.tpu._initialized
    x = torch.ones(2, device="tpu")
    devices, states = get_device_states(x)
    assert devices == [0]
    assert torch.equal(states[0], torch.tpu.get_rng_state())
