"""Captured module calls (Note [Captured module calls] in torchjax/compile/_captured.py):
in fused eager mode a repeated tpu module call runs as one program, with eager's bits."""

import copy
import threading
import warnings

import pytest
import torch
import transformers as tf

import torchjax
from tests._models import IDS, tiny_llama
from tests.compile._capture_stats import capture_counts
from torchjax.compile import _captured
from torchjax.ops import executables

TPU = "tpu"


pytestmark = pytest.mark.usefixtures("fresh_executables")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_llama_forward_is_captured_with_eagers_bits(dtype):
    model = tiny_llama().to(TPU).to(dtype)
    ids = IDS.to(TPU)
    with torch.no_grad():
        eager = model(ids).logits.cpu()
        torchjax.reset_stats()
        outs, counts = [], []
        with torchjax.fused():
            for _ in range(4):
                outs.append(model(ids).logits.cpu())
                counts.append((*capture_counts(), torchjax.stats()["fused_ops"]))
    for out in outs:
        assert torch.equal(out, eager)
    # First call op by op, second traced and run, then the program alone.
    assert counts[0][:3] == (0, 0, 0) and counts[0][3] > 50
    assert counts[1][:3] == (1, 1, 0)
    assert counts[3] == (3, 1, 0, counts[1][3])  # no op recorded by calls 3 and 4


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # a host read: cannot be traced
            return y * 2
        return y - 1


def test_data_dependent_branch_falls_back_op_by_op():
    torch.manual_seed(0)
    cpu = _Branchy()
    model = _Branchy().to(TPU)
    model.load_state_dict(cpu.state_dict())
    xs = [torch.randn(3, 4) for _ in range(4)]
    torchjax.reset_stats()
    with torch.no_grad(), torchjax.fused():
        outs = [model(x.to(TPU)).cpu() for x in xs]
    with torch.no_grad():
        want = [cpu(x) for x in xs]
    for got, w in zip(outs, want):
        torch.testing.assert_close(got, w)
    # The second call tried once and refused; the rest ran op by op without trying.
    assert capture_counts() == (0, 0, 1)
    (reason,) = torchjax.stats()["capture_refusal_reasons"].values()
    assert reason.startswith("DataDependentError: ") and "reads a tensor's value" in reason


def test_a_refusal_keeps_its_reason_per_module_until_reset():
    # Note [Captured module calls]: a refusal is silent; stats() says why.
    torch.manual_seed(0)
    branchy, bn = _Branchy().to(TPU), torch.nn.Sequential(torch.nn.BatchNorm1d(4)).to(TPU)
    x = torch.randn(3, 4).to(TPU)
    torchjax.reset_stats()
    assert torchjax.stats()["capture_refusal_reasons"] == {}
    with torch.no_grad(), torchjax.fused():
        for _ in range(2):
            branchy(x)
            bn(x)
    reasons = torchjax.stats()["capture_refusal_reasons"]
    assert capture_counts() == (0, 0, 2) and sorted(reasons) == ["Sequential", "_Branchy"]
    assert reasons["_Branchy"].startswith("DataDependentError: aten::_local_scalar_dense")
    # Batch norm's handler computes off the compiled path: the operations are named.
    assert reasons["Sequential"].startswith("TraceError: Sequential: a captured call would ")
    assert "outside the ops' own programs" in reasons["Sequential"]
    torchjax.reset_stats()
    assert torchjax.stats()["capture_refusal_reasons"] == {}


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_attribute_and_config_changes_retrace():
    torch.manual_seed(0)
    model = _Scaled().to(TPU)
    x = torch.randn(3, 4).to(TPU)
    with torch.no_grad():
        eager2 = model(x).cpu()
        model.scale = 3.0
        eager3 = model(x).cpu()
        model.scale = 2.0
        torchjax.reset_stats()
        with torchjax.fused():
            a = [model(x).cpu() for _ in range(3)]
            model.scale = 3.0
            b = [model(x).cpu() for _ in range(3)]
    assert all(torch.equal(t, eager2) for t in a)
    assert all(torch.equal(t, eager3) for t in b)
    assert capture_counts() == (4, 2, 0)

    llama = tiny_llama().to(TPU)
    ids = IDS.to(TPU)
    with torch.no_grad():
        want = llama(ids, output_hidden_states=True)
        llama.config.output_hidden_states = True
        want_config = llama(ids)
        llama.config.output_hidden_states = False
        torchjax.reset_stats()
        with torchjax.fused():
            for _ in range(2):
                got = llama(ids)
            llama.config.output_hidden_states = True
            for _ in range(2):
                got_config = llama(ids)
    assert got.hidden_states is None and len(got_config.hidden_states) == 3
    assert torch.equal(got.logits.cpu(), want.logits.cpu())
    for g, w in zip(got_config.hidden_states, want_config.hidden_states):
        assert torch.equal(g.cpu(), w.cpu())
    assert capture_counts() == (2, 2, 0)


def test_batchnorm_buffers_written_as_in_eager():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    xs = [torch.randn(5, 4).to(TPU) for _ in range(4)]

    def run():
        model = copy.deepcopy(cpu).to(TPU)
        with torch.no_grad():
            train = [model(x).cpu() for x in xs]  # running statistics updated
            model.eval()
            evals = [model(x).cpu() for x in xs]
        return train + evals + [b.cpu() for b in model.buffers()]

    eager, fused = _eager_and_fused(run)
    for got, want in zip(fused, eager):
        assert torch.equal(got, want)
    assert fused[-1].item() == 4  # num_batches_tracked
    # Batch norm runs off the compiled path (a handler computing it op by op, in
    # training and in eval mode): both signatures are refused and record op by op.
    assert capture_counts() == (0, 0, 2)


class _Running(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        y = self.lin(x)
        self.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
        self.steps.add_(1)
        return y - self.mean


def test_buffers_written_in_place_are_written_back_as_in_eager():
    torch.manual_seed(0)
    cpu = _Running()
    xs = [torch.randn(5, 4).to(TPU) for _ in range(5)]

    def run():
        model = copy.deepcopy(cpu).to(TPU)
        kept = model.mean  # a reference the user holds sees the writes
        with torch.no_grad():
            outs = [model(x).cpu() for x in xs]
        return outs + [kept.cpu(), model.steps.cpu()]

    eager, fused = _eager_and_fused(run)
    for got, want in zip(fused, eager):
        assert torch.equal(got, want)
    assert fused[-1].item() == 5
    assert capture_counts() == (4, 1, 0)


def _eager_and_fused(fn):
    """``fn()`` in plain eager, then in fused mode (the same model, fresh caches)."""
    eager = fn()
    executables.clear_caches()
    torchjax.reset_stats()
    with torchjax.fused():
        fused = fn()
    return eager, fused


def test_static_cache_decode_steps_write_the_cache_as_eager():
    model = tiny_llama().to(TPU)

    def decode():
        cache = tf.StaticCache(config=model.config, max_cache_len=16)
        logits = []
        with torch.no_grad():
            out = model(IDS.to(TPU), cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for step in range(5):
                pos = torch.tensor([IDS.shape[1] + step]).to(TPU)
                out = model(token, cache=cache, cache_position=pos, use_cache=True)
                logits.append(out.logits.cpu())
                token = out.logits[:, -1:].argmax(-1)
        keys = [layer.keys.cpu() for layer in cache.layers]
        return logits, keys

    (eager_logits, eager_keys), (logits, keys) = _eager_and_fused(decode)
    for a, b in zip(logits + keys, eager_logits + eager_keys):
        assert torch.equal(a, b)
    calls, traces, refusals = capture_counts()
    assert (calls, traces, refusals) == (4, 1, 0)  # decode steps 2-5


def test_greedy_generate_tokens_equal_cpu_with_capture_on():
    cpu = tiny_llama()
    want = cpu.generate(IDS, max_new_tokens=10, do_sample=False, disable_compile=True)
    model = tiny_llama().to(TPU)
    counts = []
    for _ in range(2):
        torchjax.reset_stats()
        with torchjax.fused():
            got = model.generate(
                IDS.to(TPU), max_new_tokens=10, do_sample=False, disable_compile=True
            )
        assert torch.equal(got.cpu(), want)
        counts.append(capture_counts())
    # A static cache (Note [A static cache for eager generate on tpu]): decode steps repeat.
    # The first generate records its first decode step and traces the second; the next
    # generate, with a new StaticCache of the same layout, runs every decode step
    # captured (Note [Captured calls are keyed by layout]).
    assert counts == [(8, 1, 0), (9, 0, 0)]


def test_dynamic_cache_steps_are_not_traced_across_generate_calls():
    cpu = tiny_llama()
    kwargs = dict(max_new_tokens=6, do_sample=False, disable_compile=True)
    want = cpu.generate(IDS, cache_implementation="dynamic", **kwargs)
    model = tiny_llama().to(TPU)
    torchjax.reset_stats()
    for _ in range(2):
        with torchjax.fused():
            got = model.generate(IDS.to(TPU), cache_implementation="dynamic", **kwargs)
        assert torch.equal(got.cpu(), want)
    # Every step has new shapes, and each generate a new DynamicCache, keyed by identity
    # (Note [Captured calls are keyed by layout]): nothing repeats, nothing is traced.
    assert capture_counts() == (0, 0, 0)


def test_capture_false_and_plain_eager_record_or_run_op_by_op():
    model = torch.nn.Linear(4, 3).to(TPU)
    x = torch.randn(2, 4).to(TPU)
    torchjax.reset_stats()
    with torch.no_grad():
        for _ in range(3):
            model(x)
        with torchjax.fused(capture=False):
            for _ in range(3):
                model(x)
    assert capture_counts() == (0, 0, 0)


def test_too_many_signatures_stop_capturing_with_a_warning(monkeypatch):
    monkeypatch.setattr(_captured, "MAX_SIGNATURES", 2)
    model = torch.nn.Linear(4, 3).to(TPU)
    torchjax.reset_stats()
    with torch.no_grad(), torchjax.fused(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (1, 1, 2, 2, 3, 3, 3):
            out = model(torch.ones(rows, 4).to(TPU))
            assert out.shape == (rows, 3)
    assert capture_counts() == (2, 2, 0)
    msgs = [str(w.message) for w in caught if issubclass(w.category, torchjax.RetraceWarning)]
    assert len(msgs) == 1 and "Linear traced 2 signatures" in msgs[0]


def test_threads_capture_the_same_module_without_seeing_each_other():
    model = tiny_llama().to(TPU)
    inputs = [IDS, IDS.flip(1)]
    with torch.no_grad():
        want = [model(ids.to(TPU)).logits.cpu() for ids in inputs]
    got = {}
    barrier = threading.Barrier(2)

    def worker(i):
        ids = inputs[i].to(TPU)
        barrier.wait()
        with torch.no_grad(), torchjax.fused():
            got[i] = [model(ids).logits.cpu() for _ in range(4)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    torchjax.reset_stats()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(got) == [0, 1]
    for i in range(2):
        for out in got[i]:
            assert torch.equal(out, want[i])
    # One signature (same shapes): traced once, by whichever thread got there first.
    calls, traces, refusals = capture_counts()
    assert traces == 1 and refusals == 0 and calls >= 5
