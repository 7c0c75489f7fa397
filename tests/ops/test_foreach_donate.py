"""Plain eager in-place foreach calls give their lead list's old values to XLA (Note
[In-place foreach calls donate their old values] in torchjax/ops/foreach_donate.py):
every old value nothing else holds, or none; values as on CPU either way."""

import warnings

import jax
import pytest
import torch

import torchjax
from torchjax.ops import executables, foreach_donate

TPU = "tpu"


@pytest.fixture(autouse=True)
def _fresh_executables():
    executables.clear_caches()


def _donations():
    return torchjax.stats()["foreach_donations"]


def _lists(n=3, size=256, dtype=torch.float32):
    torch.manual_seed(0)
    cpu = [torch.randn(size, dtype=dtype) for _ in range(n)]
    return cpu, [t.to(TPU) for t in cpu]


def _assert_equal(tpu, cpu):
    assert len(tpu) == len(cpu) > 0
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_in_place_call_donates_every_old_value(dtype):
    cpu, tpu = _lists(dtype=dtype)
    others = [t * 0.5 for t in cpu]
    before = _donations()
    for lists in (cpu, tpu):
        o = others if lists is cpu else [t.to(TPU) for t in others]
        torch._foreach_mul_(lists, 1.5)
        torch._foreach_add_(lists, o, alpha=0.25)
        torch._foreach_addcmul_(lists, o, o, value=2.0)
    _assert_equal(tpu, cpu)
    assert _donations() - before == 3 * len(tpu)


def test_an_out_of_place_call_donates_nothing():
    cpu, tpu = _lists()
    before = _donations()
    out = torch._foreach_mul(tpu, 2.0)
    _assert_equal(out, [t * 2.0 for t in cpu])
    _assert_equal(tpu, cpu)
    assert _donations() == before


def _clone_of_one(tpu):
    kept = tpu[1].clone()  # shares the array (jax arrays are immutable)
    assert kept._storage.arr is tpu[1]._storage.arr
    return kept.cpu


def _array_of_one(tpu):
    arr = torchjax.to_jax(tpu[1])
    return lambda: torch.from_numpy(jax.device_get(arr).copy())


def _view_of_one(tpu):
    view = tpu[1].view(16, 16)
    view._value()  # its read cache: an array of its own, the old values
    return view.clone().cpu


@pytest.mark.parametrize("holder", [_clone_of_one, _array_of_one])
def test_one_old_value_held_elsewhere_means_none_is_donated(holder):
    cpu, tpu = _lists()
    read, old = holder(tpu), cpu[1].clone()
    before = _donations()
    torch._foreach_add_(tpu, 1.0)
    torch._foreach_add_(cpu, 1.0)
    _assert_equal(tpu, cpu)
    assert _donations() == before
    torch.testing.assert_close(read(), old, rtol=0, atol=0)


def test_a_view_of_a_written_tensor_sees_the_new_values():
    cpu, tpu = _lists()
    view = tpu[1].view(16, 16)
    old = view.cpu()
    torch._foreach_add_(tpu, 1.0)
    torch._foreach_add_(cpu, 1.0)
    _assert_equal(tpu, cpu)
    torch.testing.assert_close(view.cpu(), cpu[1].view(16, 16), rtol=0, atol=0)
    assert not torch.equal(view.cpu(), old)


def test_a_list_naming_one_tensor_twice_donates_nothing():
    cpu, tpu = _lists()
    before = _donations()
    torch._foreach_add_([tpu[0], tpu[1], tpu[0]], 1.0)
    torch._foreach_add_([cpu[0], cpu[1], cpu[0]], 1.0)
    _assert_equal(tpu, cpu)
    assert _donations() == before


def test_a_view_in_the_list_donates_nothing():
    cpu, tpu = _lists()
    before = _donations()
    torch._foreach_mul_([tpu[0], tpu[1][:128]], 3.0)
    torch._foreach_mul_([cpu[0], cpu[1][:128]], 3.0)
    _assert_equal(tpu, cpu)
    assert _donations() == before


def test_calls_under_a_trace_donate_nothing():
    cpu, tpu = _lists()

    def step(ts):
        torch._foreach_add_(ts, 1.0)
        return ts

    before = _donations()
    out = torchjax.jit(step)(tpu)
    _assert_equal(out, [t + 1.0 for t in cpu])
    assert _donations() == before


def test_a_loop_compiles_the_donating_program_once():
    cpu, tpu = _lists()
    torch._foreach_mul_(tpu, 0.5)  # warm
    compiles = torchjax.stats()["compiles"]
    for _ in range(4):
        torch._foreach_mul_(tpu, 0.5)
        torch._foreach_mul_(cpu, 0.5)
    torch._foreach_mul_(cpu, 0.5)
    _assert_equal(tpu, cpu)
    assert torchjax.stats()["compiles"] == compiles


def test_a_call_out_of_device_memory_runs_element_by_element(monkeypatch):
    # The whole-list program does not fit (and consumed nothing): the call runs element
    # by element, and so do the key's later calls.
    calls = []

    def failing(run, dyn, donated):
        calls.append(donated)
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory")

    monkeypatch.setattr(foreach_donate, "call", failing)
    cpu, tpu = _lists()
    info = lambda: torchjax.stats()["ops"].get("aten::_foreach_add_.Scalar", {})  # noqa: E731
    with pytest.warns(ResourceWarning, match="does not fit in device memory"):
        torch._foreach_add_(tpu, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls go element by element quietly
        torch._foreach_add_(tpu, 1.0)
    for _ in range(2):
        torch._foreach_add_(cpu, 1.0)
    _assert_equal(tpu, cpu)
    assert len(calls) == 1
    assert info().get("op_by_op") == 2


def _adamw(device):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 32).to(device)) for _ in range(4)]
    opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(3):
        torch.manual_seed(step)
        for p in ps:
            p.grad = torch.randn(64, 32).to(device)
        opt.step()
    return [p.detach().cpu() for p in ps]


def test_adamw_in_plain_eager_donates_its_state_with_the_same_bits(monkeypatch):
    before = _donations()
    got = _adamw(TPU)
    assert _donations() - before >= 3 * 3 * 4  # parameters and both moments, each step
    monkeypatch.setattr(foreach_donate, "positions", lambda *args: ())
    _assert_equal([t.to(TPU) for t in got], _adamw(TPU))
    # CPU torch's float32 sqrt (MKL's vector math) is not correctly rounded: the last bit.
    for a, b in zip(got, _adamw("cpu"), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "alias",
    [
        lambda a: jax.device_put(a, jax.devices()[0]),  # a new object over a's buffer
        lambda a: jax.numpy.from_dlpack(a),
    ],
    ids=["device_put", "dlpack"],
)
def test_an_array_user_jax_code_holds_under_another_name_is_not_donated(alias):
    # Note [Arrays shared with JAX code are not donated]: a reference count sees the
    # objects, not the buffer they share.
    cpu, tpu = _lists()
    held = alias(torchjax.to_jax(tpu[1]))  # the array to_jax gave is dropped
    old = cpu[1].clone()
    before = _donations()
    torch._foreach_add_(tpu, 1.0)
    torch._foreach_add_(cpu, 1.0)
    _assert_equal(tpu, cpu)
    assert _donations() == before
    torch.testing.assert_close(torch.from_numpy(jax.device_get(held).copy()), old, rtol=0, atol=0)
    # The next values are torchjax's own: donated again.
    torch._foreach_add_(tpu, 1.0)
    assert _donations() - before == len(tpu)


def test_a_tensor_made_from_a_jax_array_never_donates_it():
    a = jax.numpy.arange(8.0)
    t = torchjax.from_jax(jax.device_put(a, jax.devices()[0]))
    del_me = [t]
    before = _donations()
    torch._foreach_mul_(del_me, 2.0)
    assert _donations() == before
    assert not a.is_deleted()
    torch.testing.assert_close(t.cpu(), torch.arange(8.0) * 2, rtol=0, atol=0)
