"""Every optimizer a jitted step reaches is state (the walk in
torchjax/compile/_state.py), also one a leaf's gradient hook steps (optimizer in
backward), and each switches to capturable mode: their state carries across calls, as
on CPU."""

import torch

import torchjax


def test_two_optimizers_in_one_step_both_step_on_the_device():
    # A step with two optimizers (a GAN's generator and discriminator): both switch to
    # capturable mode at the first call; the second stayed off, and Adam's step read its
    # counter into Python inside the trace (DataDependentError).
    results = {}
    for dev, jit in (("cpu", False), ("tpu", True)):
        torch.manual_seed(0)
        g, d = torch.nn.Linear(4, 4).to(dev), torch.nn.Linear(4, 1).to(dev)
        opt_g = torch.optim.Adam(g.parameters(), lr=1e-2)
        opt_d = torch.optim.AdamW(d.parameters(), lr=1e-2)

        def step(x, g=g, d=d, opt_g=opt_g, opt_d=opt_d):
            loss = d(g(x)).pow(2).mean()
            loss.backward()
            opt_g.step()
            opt_d.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
            return loss.detach()

        run = torchjax.jit(step) if jit else step
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(dev)
        losses = [run(x).cpu() for _ in range(3)]
        results[dev] = (losses, [p.detach().cpu() for p in (*g.parameters(), *d.parameters())])
    torch.testing.assert_close(torch.stack(results["tpu"][0]), torch.stack(results["cpu"][0]))
    for a, b in zip(results["tpu"][1], results["cpu"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
