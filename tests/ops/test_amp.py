"""torchjax/ops/amp.py: torch.amp.GradScaler("tpu") matches GradScaler("cpu") step by step."""

import torch

TPU = "tpu"


def _train(device, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    history = []
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i)).to(device)
        if i == 3:
            x[0, 0] = float("inf")  # a non-finite gradient: the step is skipped, scale backs off
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append((scaler.get_scale(), model.weight.detach().cpu().clone()))
    return history


def test_grad_scaler_matches_cpu_through_growth_and_backoff():
    cpu, tpu = _train("cpu"), _train(TPU)
    assert [s for s, _ in tpu] == [s for s, _ in cpu] == [1024, 2048, 2048, 1024, 1024, 2048]
    for (_, w_cpu), (_, w_tpu) in zip(cpu, tpu):
        torch.testing.assert_close(w_tpu, w_cpu, rtol=1e-6, atol=1e-7)


def test_unscale_half_gradients_and_found_inf():
    grads = [torch.tensor([2.0, 4.0], dtype=torch.bfloat16), torch.tensor([1.0, float("nan")])]
    found = {}
    for device in ("cpu", TPU):
        gs = [g.clone().to(device) for g in grads]
        found_inf = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            gs, found_inf, torch.full((1,), 0.5, device=device)
        )
        found[device] = (found_inf.cpu(), [g.cpu() for g in gs])
    assert found[TPU][0].item() == found["cpu"][0].item() == 1.0
    for a, b in zip(found[TPU][1], found["cpu"][1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, equal_nan=True)
