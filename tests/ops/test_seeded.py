"""Random ops as cached executables whose key is an argument (Note [Compiled random ops])."""

import jax
import numpy as np
import torch

import torchjax
from torchjax.ops import cached_compute, executables
from torchjax.tensor import random as rng

DRAWS = {
    "normal_": lambda x: x.normal_(),
    "uniform_": lambda x: x.uniform_(-2, 3),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "exponential_": lambda x: x.exponential_(),
    "random_": lambda x: x.random_(0, 7),
    "dropout": lambda x: torch.nn.functional.dropout(x, 0.5),
    "multinomial": lambda x: torch.multinomial(x.abs() + 0.1, 2),
}


def test_each_random_op_is_one_cached_executable_with_fresh_values():
    # Counts plain eager's executables (fused eager records the draws instead).
    with torchjax.fused(False):
        _each_draw_is_one_cached_executable()


def _each_draw_is_one_cached_executable():
    x = torch.ones(64, device="tpu")
    for name, draw in DRAWS.items():
        executables.clear_caches()
        torch.manual_seed(1)
        first = [draw(x.clone()).cpu() for _ in range(3)]
        torch.manual_seed(1)
        again = [draw(x.clone()).cpu() for _ in range(3)]
        info = [i for op, i in cached_compute.cache_info().items() if i.calls or i.op_by_op]
        random_info = [i for i in info if i.calls >= 6]
        assert random_info and all(i.op_by_op == 0 for i in random_info), (name, info)
        assert all(i.traces == 1 for i in random_info), name
        for a, b in zip(first, again):
            assert torch.equal(a, b), name  # replayed after manual_seed
        assert not torch.equal(first[0], first[1]), name  # a new key per call


def test_one_draw_ops_give_the_op_by_op_key():
    # The call's key is fold_in(key(seed), counter), the key next_key would give.
    torch.manual_seed(5)
    before = rng.get_state().numpy().view(np.uint64)[1]
    got = torch.empty(16, device="tpu").uniform_().cpu()
    base = jax.random.wrap_key_data(rng._state(0).words(), impl="threefry2x32")
    with jax.enable_x64(True):
        want = jax.random.uniform(jax.random.fold_in(base, int(before)), (16,), jax.numpy.float32)
    assert torch.equal(got, torch.from_numpy(np.asarray(want)))
    assert rng.get_state().numpy().view(np.uint64)[1] == before + 1


def test_cpu_generator_and_outer_trace_keep_their_own_draws():
    g = torch.Generator().manual_seed(3)
    got = torch.empty(8, device="tpu").normal_(generator=g).cpu()
    assert torch.equal(got, torch.empty(8).normal_(generator=torch.Generator().manual_seed(3)))

    @torchjax.jit
    def noisy(x):
        return x + torch.randn_like(x)

    x = torch.zeros(8, device="tpu")
    assert not torch.equal(noisy(x).cpu(), noisy(x).cpu())
    assert noisy.trace_count == 1


def test_samplers_do_not_make_the_zeros_they_overwrite(monkeypatch):
    # Note [Samplers read no values]: torch.randn is empty + normal_; the empty
    # storage's zeros are never made (no transfer, no fill program).
    from torchjax.tensor import _storage

    made = []
    real = _storage._filled
    monkeypatch.setattr(_storage, "_filled", lambda *a: made.append(a) or real(*a))
    draws = [
        torch.randn(3, 5, device="tpu"),
        torch.rand(7, device="tpu", dtype=torch.bfloat16),
        torch.randint(0, 9, (4,), device="tpu"),
        torch.empty(6, device="tpu").exponential_(),
    ]
    assert made == []
    assert [d.shape for d in draws] == [(3, 5), (7,), (4,), (6,)]
    assert draws[1].dtype == torch.bfloat16 and draws[2].dtype == torch.int64
    assert (draws[3].cpu() > 0).all() and draws[2].cpu().max() < 9
    # A tensor read before it is written still reads its zeros.
    assert torch.equal(torch.zeros(2, 2, device="tpu").cpu(), torch.zeros(2, 2))
    assert made
