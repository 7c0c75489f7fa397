"""Every optimizer a jitted step reaches is state (the walk in
torchjax/compile/_state.py), also one a leaf's gradient hook steps (optimizer in
backward), and each switches to capturable mode: their state carries across calls, as
on CPU."""

import pytest
import torch

import torchjax

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_stepped_in_backward_keeps_its_state(name):
    results = {}
    for dev, jit in (("cpu", False), ("tpu", True)):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2).to(dev)
        opts = {p: OPTIMIZERS[name]([p]) for p in net.parameters()}

        def hook(p, opts=opts):
            opts[p].step()
            opts[p].zero_grad()

        for p in net.parameters():
            p.register_post_accumulate_grad_hook(hook)

        def step(x, net=net):
            loss = net(x).pow(2).mean()
            loss.backward()
            return loss.detach()

        run = torchjax.jit(step) if jit else step
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(dev)
        losses = [run(x).cpu() for _ in range(4)]
        results[dev] = (losses, [p.detach().cpu() for p in net.parameters()], opts)
        if jit:
            assert run.trace_count <= 2
    (want, want_params, cpu_opts), (got, got_params, tpu_opts) = results["cpu"], results["tpu"]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for g, w in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for oc, ot in zip(cpu_opts.values(), tpu_opts.values(), strict=True):
        (sc,), (st,) = oc.state.values(), ot.state.values()
        assert sc.keys() == st.keys() and sc
        for k in sc:
            torch.testing.assert_close(st[k].cpu().to(sc[k].dtype), sc[k], rtol=1e-5, atol=1e-6)


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
