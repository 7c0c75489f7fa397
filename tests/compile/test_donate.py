"""torchjax/compile/_donate.py: a jitted step donates the buffers of the state it
overwrites, never a buffer the user holds (a clone, a state_dict copy, a copy_ target,
an array from torchjax.to_jax, tensors loaded into the model)."""

import weakref

import torch

import torchjax


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = model.to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, opt, torchjax.jit(train)


def test_copies_taken_between_steps_survive_the_next_steps():
    model, opt, step = _setup()
    x = torch.randn(3, 4, device="tpu")
    step(x)
    step(x)
    w = model[0].weight
    snapshot = w.detach().cpu()
    held = {
        "clone": w.detach().clone(),
        "clone of the parameter": w.clone(),
        "state_dict of clones": {k: v.clone() for k, v in model.state_dict().items()},
        "empty_like().copy_()": torch.empty_like(w).copy_(w),
        "momentum buffer clone": opt.state[w]["momentum_buffer"].clone(),
        "to_jax": torchjax.to_jax(w.detach()),
    }
    buf_snapshot = opt.state[w]["momentum_buffer"].cpu()
    for _ in range(3):
        step(x)
    assert not torch.equal(w.detach().cpu(), snapshot)  # the model did train
    for what, v in held.items():
        if isinstance(v, dict):
            v = v["0.weight"]
        got = torch.from_numpy(v.__array__().copy()) if what == "to_jax" else v.cpu()
        want = buf_snapshot if what.startswith("momentum") else snapshot
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    assert step.donation_copies >= len(held) - 1  # the two clones share one buffer


def test_tensors_loaded_into_the_model_stay_the_users():
    model, _, step = _setup()
    x = torch.randn(3, 4, device="tpu")
    step(x)
    step(x)
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(mine)  # copy_ into the parameters: they share the buffers
    want = {k: v.cpu() for k, v in mine.items()}
    step(x)
    step(x)
    for k, v in mine.items():
        torch.testing.assert_close(v.cpu(), want[k], rtol=0, atol=0, msg=k)


def test_a_plain_training_loop_donates_without_copies():
    model, _, step = _setup()
    x = torch.randn(3, 4, device="tpu")
    step(x)
    step(x)
    assert any(e.donated for e in step._entries.values())
    old = weakref.ref(model[0].weight._storage.arr)  # a weak reference holds nothing
    for _ in range(5):
        step(x)
    assert step.donation_copies == 0
    assert old() is None or old().is_deleted()
    # A read of the parameter between steps (logging it) is its own: still no copy.
    float(model[0].weight.detach().sum())
    step(x)
    assert step.donation_copies == 0
