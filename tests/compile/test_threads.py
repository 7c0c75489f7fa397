"""A torchjax.jit trace never leaks into another thread: the RNG stream and the
parameter bindings of a trace are per thread (torchjax/tensor/random.py,
Note [Bindings are per thread] in torchjax/tensor/_binding.py)."""

import os
import threading
import time

import pytest
import torch

import torchjax
from tests.integrations.tiny_models import save_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_WAIT = 60  # seconds; only reached when something hangs


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _during_a_trace(model, other):
    """Run ``other()`` in a second thread while this thread is inside a trace of
    ``model`` (the traced code waits for it), and return what it returned or raised."""
    inside, finished = threading.Event(), threading.Event()
    result = {}

    def traced(x):
        y = model(x) + torch.rand(4, device="tpu")
        inside.set()
        assert finished.wait(_WAIT)
        return y

    def run_other():
        assert inside.wait(_WAIT)
        try:
            result["value"] = other()
        except BaseException as e:  # reported by the caller
            result["error"] = e
        finally:
            finished.set()

    thread = threading.Thread(target=run_other)
    thread.start()
    f = torchjax.jit(traced)
    with torch.no_grad():
        out = f(torch.randn(2, 8, device="tpu"))
    thread.join(_WAIT)
    assert f.trace_count == 1 and out.shape == (2, 4)
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_eager_rand_in_another_thread_while_tracing():
    model = _mlp().to("tpu")
    r = _during_a_trace(model, lambda: torch.rand(3, device="tpu"))
    assert r.shape == (3,) and 0 <= float(r.min()) and float(r.max()) < 1


def test_eager_forward_of_the_traced_module_in_another_thread():
    cpu = _mlp()
    model = _mlp().to("tpu")
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = cpu(x)

    def forward():
        with torch.no_grad():
            return model(x.to("tpu")).cpu()

    torch.testing.assert_close(_during_a_trace(model, forward), want, rtol=1e-5, atol=1e-6)
    # The trace's bindings are gone: this thread's eager forward reads the parameters.
    with torch.no_grad():
        torch.testing.assert_close(model(x.to("tpu")).cpu(), want, rtol=1e-5, atol=1e-6)


def test_eager_write_in_another_thread_while_tracing_reaches_the_parameter():
    model = _mlp().to("tpu")

    def write():
        with torch.no_grad():
            model[0].bias.fill_(3.0)

    _during_a_trace(model, write)
    assert model[0].bias.cpu().tolist() == [3.0] * 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_gpt2"))
    save_tiny("gpt2", path)
    return path


def test_four_threads_mixing_eager_traces_loading_and_rand(tiny_dir):
    import transformers as tf

    cpu = _mlp()
    shared = _mlp().to("tpu")
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = cpu(x)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    want_ab = a @ b
    ref = tf.AutoModelForCausalLM.from_pretrained(tiny_dir)
    want_wte = ref.transformer.wte.weight.detach()
    start = time.monotonic()
    for round_ in range(20):
        _stress_round(round_, shared, x, want, a, b, want_ab, tiny_dir, want_wte)
    assert time.monotonic() - start < 240  # ~60 s on a quiet machine


def _stress_round(round_, shared, x, want, a, b, want_ab, tiny_dir, want_wte):
    import transformers as tf

    errors = []
    tracing = threading.Event()

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    def eager_ops():
        while not tracing.is_set():
            got = (a.to("tpu") @ b.to("tpu")).cpu()
            torch.testing.assert_close(got, want_ab, rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                out = shared(x.to("tpu")).cpu()
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)

    def traces(k=round_):
        try:
            f = torchjax.jit(lambda t: shared(t) * (k + 1))  # a new function: a trace
            with torch.no_grad():
                out = f(x.to("tpu")).cpu()
            torch.testing.assert_close(out, want * (k + 1), rtol=1e-5, atol=1e-5)
            assert f.trace_count == 1
        finally:
            tracing.set()

    def load():
        m = tf.AutoModelForCausalLM.from_pretrained(tiny_dir, device_map="tpu")
        assert m.transformer.wte.weight.device.type == "tpu"
        torch.testing.assert_close(m.transformer.wte.weight.detach().cpu(), want_wte)

    def rand():
        while not tracing.is_set():
            r = torch.rand(64, device="tpu")
            assert r.shape == (64,) and 0 <= float(r.min()) and float(r.max()) < 1

    threads = [threading.Thread(target=guard(f)) for f in (eager_ops, traces, load, rand)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_WAIT)
    assert not any(t.is_alive() for t in threads), f"round {round_}: a thread hung"
    assert not errors, f"round {round_}: {errors!r}"


def test_threads_calling_a_new_function_at_once_trace_it_once():
    model = _mlp().to("tpu")
    jitted = torchjax.jit(model)
    x = torch.randn(2, 8).to("tpu")
    barrier = threading.Barrier(4)
    outs, errors = [None] * 4, []

    def call(i):
        try:
            barrier.wait(_WAIT)
            outs[i] = jitted(x).cpu()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_WAIT)
    assert not errors, errors
    assert jitted.trace_count == 1 and jitted.cache_hits == 3
    with torch.no_grad():
        expected = model(x).cpu()
    for out in outs:
        torch.testing.assert_close(out, expected)
