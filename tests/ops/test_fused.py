"""Fused eager mode (torchjax/ops/fused.py): recorded segments give eager's exact values."""

import copy
import threading

import jax
import pytest
import torch

import torchjax
from tests._child import run_python
from tests._models import IDS, tiny_llama
from torchjax.device import _checks
from torchjax.ops import executables
from torchjax.ops import fused as F

TPU = "tpu"


@pytest.fixture(autouse=True)
def _fresh_executables():
    # Eager's own path depends on what the process compiled before (a key past
    # MAX_VIEW_SIGNATURES reads its views first, a different program): both modes of a
    # test start from empty caches, so they take the same per-op programs.
    executables.clear_caches()


def _fused_counts():
    s = torchjax.stats()
    return s["fused_ops"], s["fused_segments"], s["fused_compiles"]


def _both(fn, *args, recorded=True):
    """``fn(*args)`` in eager and in fused mode, as CPU tensors (lists of them)."""
    eager = fn(*args)
    with torchjax.fused():
        out = fn(*args)
        # Still recorded inside the block: something has not run yet.
        outs = out if isinstance(out, (tuple, list)) else [out]
        assert not recorded or any(F.is_pending(t._storage.lazy) for t in outs)
    conv = lambda t: t.cpu() if isinstance(t, torch.Tensor) else [x.cpu() for x in t]  # noqa: E731
    return conv(eager), conv(out)


def _same(a, b):
    if isinstance(a, list):
        for x, y in zip(a, b):
            _same(x, y)
        return
    torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_elementwise_chain_is_one_segment_and_bit_identical(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 17, generator=g) * 5).to(dtype).to(TPU)
    y = (torch.randn(33, 17, generator=g) * 5).to(dtype).to(TPU)

    def chain(x, y):
        z = x * y + x - 3 * y
        if dtype.is_floating_point:
            z = torch.exp(z.tanh()) / (y.abs() + 1) + torch.sigmoid(x) * torch.sqrt(y.abs())
        else:
            z = (z // 7) % 5 + (x & y) - torch.maximum(x, y)
        return z * 2 - x

    torchjax.reset_stats()
    eager, fused = _both(chain, x, y)
    _same(eager, fused)
    ops, segments, _ = _fused_counts()
    assert ops >= 5 and segments == 1


def test_fma_contraction_and_reduction_fusion_keep_eager_numbers():
    # a * b then + c fused by LLVM into an FMA, and a producer fused into a sum by
    # XLA:CPU, both change the last bit (Note [Fusion keeps eager's numbers] in
    # torchjax/ops/fusion_cuts.py). The FMA only happens at XLA's default optimisation
    # level, which the suite lowers (Note [Compile speed in the suite]): a child process
    # at the default level.
    code = """
        import torch, torchjax
        g = torch.Generator().manual_seed(1)
        a, b, c = (torch.randn(64, 256, generator=g).to("tpu") for _ in range(3))
        f = lambda: [a * b + c, (a * a).sum(0), a.exp().sum(1), a / b.abs().sqrt()]
        eager = [t.cpu() for t in f()]
        with torchjax.fused():
            out = f()
        for e, o in zip(eager, out):
            torch.testing.assert_close(o.cpu(), e, rtol=0, atol=0)
        print("ok", torchjax.stats()["fused_segments"])
    """
    done = run_python(code, env={"XLA_FLAGS": ""})
    assert done.returncode == 0, done.stderr
    assert "ok 1" in done.stdout


def test_matmul_softmax_layer_norm():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 64, generator=g).to(TPU), torch.randn(64, 64, generator=g).to(TPU)
    ln = torch.nn.LayerNorm(64).to(TPU)

    def block(x):
        h = torch.softmax(x @ w.t() / 8.0, dim=-1)
        return ln(h @ w + x).relu().mean(-1)

    with torch.no_grad():
        eager, fused = _both(block, x)
    _same(eager, fused)


def test_views_and_inplace_ops_mixed_in():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 12, generator=g)

    def prog():
        x = base.to(TPU)
        y = (x * 2).t()[1:5]  # a view of a recorded value
        z = y + 1
        z.mul_(3).add_(x[:4, 2:10])  # whole-tensor in-place writes stay recorded
        x[0].add_(z.sum())  # an in-place write into a view: a partial write
        w = torch.cat([z, x[:2, :8]]).transpose(0, 1)
        return [z, x, w.contiguous(), x.view(-1)[::5]]

    # clone (contiguous) reads its input: the last op runs it, nothing stays recorded.
    eager, fused = _both(prog, recorded=False)
    _same(eager, fused)


def test_copies_and_view_reads_of_recorded_values_stay_recorded():
    # A decode step's own reads: ``logits[:, -1, :].to(copy=True, dtype=float32)``,
    # a logits processor's ``clone()``, and ``cat`` of a growing cache with a view of the
    # new keys, which past a few shapes reads its views first (MAX_VIEW_SIGNATURES).
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 6, 10, generator=g).to(TPU)
    new = torch.randn(1, 3, 2, 4, generator=g).to(TPU)

    def step(n):
        lg = logits * 2
        last = lg[:, -1, :].to(copy=True, dtype=torch.float64)
        scores = last.clone() + lg.clone()[0, 0]
        cache = torch.zeros(1, 2, n, 4, device=TPU) + lg[0, 0, 0]
        grown = torch.cat([cache, (new * 3).transpose(1, 2)], dim=-2)
        return [scores, grown, lg.to(torch.float64)]

    for n in range(1, 6):
        torchjax.reset_stats()
        eager, fused = _both(step, n)
        _same(eager, fused)
        assert _fused_counts()[1] == 1, n  # one segment: no read ran it early


def test_copies_keep_cpus_strides_at_size_1_dims_and_stay_recorded():
    # Note [Size-1 strides in fused eager]: channels-last of a (2, 3, 1, 1) tensor is
    # (3, 1, 3, 3) on CPU, row-major data reporting other strides at size-1 dims.
    x = torch.arange(6.0).reshape(2, 3, 1, 1)
    logits = torch.arange(60.0).reshape(1, 6, 10)
    cl = torch.channels_last

    def step(x, logits):
        y = (x * 2).contiguous(memory_format=cl)  # a recorded value
        last = (logits + 1)[:, -1, :].to(copy=True, dtype=torch.float64)  # (60, 1)
        return [x.clone(memory_format=cl), y, y + 1, y.clone(), last, last * 2]

    want = step(x, logits)
    with torchjax.fused():
        torchjax.reset_stats()
        got = step(x.to(TPU), logits.to(TPU))
        assert F.is_pending(got[-1]._storage.lazy)
    assert [g.stride() for g in got] == [w.stride() for w in want]
    _same(want, [g.cpu() for g in got])
    assert _fused_counts()[1] == 1  # no read of a restrided value ran the segment early


_VIEWS = {
    "slice": lambda y: y[1:],
    "transpose": lambda y: y.t(),
    "expand": lambda y: y[:1].expand(3, 6),
}


def _recorded_in_one_segment(step, x, want):
    """``step(x)`` in fused mode reads nothing early (no segment runs inside it), runs as
    one segment, and gives ``want``'s strides and values bit for bit."""
    with torchjax.fused():
        torchjax.reset_stats()
        got = step(x.to(TPU))
        assert torchjax.stats()["fused_segments"] == 0  # no read ran the segment early
    assert [g.stride() for g in got] == [w.stride() for w in want]
    _same(want, [g.cpu() for g in got])
    assert _fused_counts()[1] == 1


@pytest.mark.parametrize("view", sorted(_VIEWS))
def test_detached_views_of_recorded_values_stay_recorded(view):
    # Backward detaches views of saved activations (a transposed weight's grad): the
    # alias only seeds a read cache, so reading the view there ran the segment early.
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def step(x):
        v = _VIEWS[view](x * 2).detach()
        return [v, v * 3, torch.ops.aten.alias(v) + 1]

    want = step(x)
    _recorded_in_one_segment(step, x, want)


_PERMUTED = {
    "clone of a transpose": lambda y: y.transpose(1, 2).clone(),
    "cast of a transpose": lambda y: y.transpose(0, 3).to(torch.float32),
    "copy of a permute": lambda y: y.permute(2, 0, 3, 1).to(copy=True),
    "channels last": lambda y: y.contiguous(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("copy", sorted(_PERMUTED))
def test_copies_at_a_permuted_layout_of_recorded_values_stay_recorded(copy):
    # SDPA and backward copy transposed activations keeping their layout
    # (preserve_format): the data in memory order is one recorded view read.
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def step(x):
        c = _PERMUTED[copy](x * 2)
        return [c, c + 1, c.sum(0)]

    want = step(x)
    assert not want[0].is_contiguous()  # a layout other than row-major
    _recorded_in_one_segment(step, x, want)


def test_cross_entropy_on_recorded_targets_stays_recorded_and_checks_them():
    # A language model's loss: shifted labels (a view), an ignored position; the target
    # check is recorded with the loss, not made by reading the targets.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, 2] = -100

    def loss(x, labels):
        # transformers' ForCausalLMLoss: the target is a view of a recorded copy.
        padded = torch.nn.functional.pad(labels, (0, 1), value=-100)
        shifted = padded[..., 1:].contiguous().view(-1)
        return torch.nn.functional.cross_entropy((x * 2).reshape(-1, 7), shifted)

    want = loss(x.to(TPU), labels.to(TPU)).cpu()  # eager's bits (CPU's within an ulp)
    torch.testing.assert_close(want, loss(x, labels))
    with torchjax.fused():
        torchjax.reset_stats()
        got = loss(x.to(TPU), labels.to(TPU))
        assert torchjax.stats()["fused_segments"] == 0  # no read ran the segment early
    _same(want, got.cpu())
    labels[1, 3] = 9
    with pytest.raises(IndexError, match=r"Target 9 is out of bounds"):
        with torchjax.fused():
            loss(x.to(TPU), labels.to(TPU))
            torch.tpu.synchronize()


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5])
def test_view_reads_survive_a_segment_full_in_the_middle_of_an_op(monkeypatch, max_nodes):
    # ``cat([cache, view])`` past MAX_VIEW_SIGNATURES records the view's read first; a
    # segment reaching MAX_NODES right then must still compute that read.
    monkeypatch.setattr(F, "MAX_NODES", max_nodes)
    g = torch.Generator().manual_seed(6)
    new = torch.randn(1, 3, 2, 4, generator=g).to(TPU)

    def step(n):
        cache = torch.zeros(1, 2, n, 4, device=TPU) + 1
        k = (new * 3).transpose(1, 2)
        return torch.cat([cache, k, (new - 1).transpose(1, 2)], dim=-2)

    for n in range(1, 6):
        eager, fused = _both(step, n, recorded=False)
        _same(eager, fused)


def test_op_that_cannot_be_recorded_runs_in_the_middle():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, generator=g).to(TPU)

    def prog():
        y = x * 3 - 1
        kept = y[y > 0]  # a boolean mask: data-dependent shape, not recorded
        return [kept * 2, (y + kept.sum()).cos()]

    torchjax.reset_stats()
    eager, fused = _both(prog)
    _same(eager, fused)
    assert _fused_counts()[1] >= 2  # the mask cut the recording in two


def test_out_of_range_index_raises_at_the_next_sync_naming_the_op():
    w = torch.randn(5, 3, device=TPU)
    with torchjax.fused():
        out = torch.index_select(w * 2, 0, torch.tensor([1, 7], device=TPU)) + 1
        assert F.is_pending(out._storage.lazy)  # nothing ran, nothing raised
        with pytest.raises(
            IndexError, match=r"index 7 is out of bounds for dimension 0 with size 5"
        ):
            out.sum().item()
        # A check of an op whose result is never read is raised at a sync too.
        torch.index_select(w, 0, torch.tensor([-9], device=TPU))
        with pytest.raises(IndexError, match="index_select"):
            torch.tpu.synchronize()
    assert _checks.pending() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_forward_is_bit_identical_and_cached(dtype):
    model = tiny_llama().to(TPU).to(dtype)
    ids = IDS.to(TPU)
    with torch.no_grad():
        eager = model(ids).logits.cpu()
        # Recorded op by op both times (a repeated call is otherwise captured: Note
        # [Captured module calls], tests/compile/test_captured.py).
        with torchjax.fused(capture=False):
            first = model(ids).logits
        torchjax.reset_stats()
        with torchjax.fused(capture=False):
            second = model(ids).logits
        stats = torchjax.stats()
    assert torch.equal(first.cpu(), eager)
    assert torch.equal(second.cpu(), eager)
    # The second identical forward reuses every segment program: nothing compiles.
    assert stats["fused_compiles"] == 0 and stats["compiles"] == 0
    assert stats["fused_ops"] > 50
    assert stats["fused_segments"] < stats["fused_ops"] / 10


def test_train_step_matches_eager():
    cpu = tiny_llama().train()
    labels = IDS.to(TPU)

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(labels, labels=labels).loss
        loss.backward()
        opt.step()
        return [loss.detach()] + [p.detach() for p in model.parameters()]

    eager = [t.cpu() for t in step(copy.deepcopy(cpu).to(TPU))]
    model = copy.deepcopy(cpu).to(TPU)
    torchjax.reset_stats()
    with torchjax.fused():
        out = step(model)
        recorded = torchjax.stats()["fused_ops"]
    _same(eager, [t.cpu() for t in out])
    assert recorded > 100  # forward, backward and the update were recorded


def test_backward_records_on_the_calling_thread_and_flushes_at_its_end():
    x = torch.randn(6, 4, device=TPU, requires_grad=True)
    (x.sin() * 3).sum().backward()
    want = x.grad.cpu()
    x.grad = None
    torchjax.reset_stats()
    with torchjax.fused():
        (x.sin() * 3).sum().backward()
        # Ran at the end of backward(), still inside the block.
        assert not F.is_pending(x.grad._storage.lazy)
        assert torchjax.stats()["fused_segments"] >= 1
    assert torch.equal(x.grad.cpu(), want)


def test_threads_have_their_own_segments():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, 32, generator=g).to(TPU) for _ in range(2)]
    want = [((x @ x).tanh() * 2 + 1).cpu() for x in xs]
    got, segs, barrier = [None, None], [None, None], threading.Barrier(2)

    def worker(i):
        with torchjax.fused():
            y = (xs[i] @ xs[i]).tanh() * 2 + 1
            barrier.wait()  # both threads hold a recorded segment at once
            segs[i] = y._storage.lazy.segment
            got[i] = y.cpu()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert segs[0] is not segs[1]
    for w, g_ in zip(want, got):
        assert torch.equal(w, g_)


def test_a_pending_value_read_by_another_thread_runs_its_segment():
    x = torch.randn(8, device=TPU)
    with torchjax.fused():
        y = x * 2 + 1
        out = []
        t = threading.Thread(target=lambda: out.append(y.cpu()))
        t.start()
        t.join()
    assert torch.equal(out[0], x.cpu() * 2 + 1)


def test_modes_nest_and_reverse():
    x = torch.ones(3, device=TPU)
    assert torchjax.eager_mode() == "eager"
    with torchjax.fused():
        assert torchjax.eager_mode() == "fused"
        a = x + 1
        with torchjax.fused(False):
            assert torchjax.eager_mode() == "eager"
            assert not F.is_pending(a._storage.lazy)  # turning it off ran the segment
            b = x + 2
            assert b._storage.lazy is None
        assert F.is_pending((x + 3)._storage.lazy)
    assert torchjax.eager_mode() == "eager"
    with pytest.raises(ValueError, match="set_eager_mode"):
        torchjax.set_eager_mode("lazy")


def test_torchjax_jit_inside_fused_mode_is_not_recorded():
    x = torch.randn(4, 4, device=TPU)
    f = torchjax.jit(lambda t: (t @ t).relu() + 1)
    want = f(x).cpu()
    with torchjax.fused():
        pre = x * 1  # a pending value passed into the trace
        torchjax.reset_stats()
        got = f(pre)
        assert torchjax.stats()["fused_ops"] == 0
    assert torch.equal(got.cpu(), want)


def test_environment_variable_turns_it_on_in_a_child_process():
    code = """
        import torch, torchjax
        from torchjax.ops import fused as F
        assert torchjax.eager_mode() == "fused"
        x = torch.arange(6.0, device="tpu")
        y = (x * 2 + 1).sin()
        assert F.is_pending(y._storage.lazy)
        assert torch.equal(y.cpu(), (torch.arange(6.0) * 2 + 1).sin())
        print("segments", torchjax.stats()["fused_segments"])
    """
    done = run_python(code, env={"TORCHJAX_EAGER": "fused"})
    assert done.returncode == 0, done.stderr
    assert "segments 1" in done.stdout
    bad = run_python("import torchjax", env={"TORCHJAX_EAGER": "lazy"})
    assert bad.returncode != 0 and "TORCHJAX_EAGER='lazy'" in bad.stderr


def test_immediate_checks_raise_at_the_op_in_fused_mode():
    w = torch.randn(5, 3, device=TPU)
    torch.tpu.set_sync_checks(True)
    try:
        with torchjax.fused():
            with pytest.raises(IndexError, match="index 7 is out of bounds"):
                torch.index_select(w, 0, torch.tensor([7], device=TPU))
    finally:
        torch.tpu.set_sync_checks(False)


def test_checks_made_at_the_op_raise_there_in_fused_mode():
    # histc over the data's range is checked at the op in eager (Note [Device-side
    # checks]): recorded, it runs its segment at once and raises there.
    x = torch.tensor([1.0, float("inf")])
    with pytest.raises(RuntimeError) as cpu:
        torch.histc(x * 2, bins=3)
    with torchjax.fused():
        with pytest.raises(RuntimeError) as got:
            torch.histc(x.to(TPU) * 2, bins=3)
        assert str(got.value) == str(cpu.value)
        good = torch.histc(x[:1].to(TPU) * 2, bins=3) + 1
        assert good.cpu().tolist() == [1.0, 2.0, 1.0]


@pytest.mark.parametrize("decimals", [1, 2, 3])
def test_division_by_a_broadcast_scalar_keeps_cpus_rounding(decimals):
    # The CPU lowering of a division by a broadcast divisor hides it behind a
    # platform-dependent optimization barrier (Note [Division by a broadcast divisor]); a
    # segment must run the CPU branch as eager does, not the default one.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(decimals)) * 100
    want = torch.round(x, decimals=decimals), x / 0.3
    eager, fused = _both(lambda t: (torch.round(t, decimals=decimals), t / 0.3), x.to(TPU))
    assert len(fused) == 2
    for w, e, f in zip(want, eager, fused):
        assert torch.equal(e, w) and torch.equal(f, w)


def test_a_pending_value_read_inside_a_trace_is_computed_concretely():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    with torchjax.fused():
        held = torch.round(x.to(TPU), decimals=1)  # pending, read by the trace below
        assert F.is_pending(held._storage.lazy)
        f = torchjax.jit(lambda t: t + held)
        got = f(torch.zeros(1000, device=TPU))
    assert not isinstance(held._storage.arr, jax.core.Tracer)
    assert torch.equal(held.cpu(), torch.round(x, decimals=1))
    assert torch.equal(got.cpu(), torch.round(x, decimals=1))


def test_ops_a_recorded_lowering_traces_are_not_recorded():
    # bfloat16 SDPA traces torch's decomposition into its executable when first
    # recorded; the causal mask inside it is built from constants. Recorded, it ran the
    # segment from inside the trace: two segments, and a program compiled again on the
    # next identical call (Note [Nothing is recorded under a trace]).
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.to(TPU) for t in (q, k, v))
    with torch.no_grad():  # plain eager: the values fused eager must give bit for bit
        want = torch.nn.functional.scaled_dot_product_attention(qt * 2, kt, vt, is_causal=True)
        want = (want + 1).cpu()
    executables.clear_caches(sdpa)  # its executable is traced again
    torch.tpu.synchronize()
    torchjax.reset_stats()
    with torch.no_grad(), torchjax.fused():
        out = torch.nn.functional.scaled_dot_product_attention(qt * 2, kt, vt, is_causal=True) + 1
        got = out.cpu()
    assert torchjax.stats()["fused_segments"] == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
