"""Compiled lowerings (torchjax/ops/cached_compute.py), compiled foreach and the fused
optimizer step: cache keying and hits, what is not compiled, tracers, and that eager ops
do not wait for device results. No timing here: bench/ measures speed."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax._compat.jax import x64
from torchjax.ops import cached_compute, executables, fused_nodes
from torchjax.tensor._tensor import wrap

aten = torch.ops.aten
TPU = "tpu"


def _info(func):
    i = cached_compute.cache_info(func)
    return (i.keys, i.traces, i.eager_keys)


@pytest.fixture(autouse=True)
def _fresh_caches():
    # Key counts depend on what ran earlier in the process (float variants, view keys
    # counted per overload): each test starts from empty caches.
    executables.clear_caches()


def test_clear_caches_drops_executables_and_counts():
    t = torch.randn(3, 5).to(TPU)
    torch.atan2(t, t)
    assert _info(aten.atan2.default)[0] == 1
    executables.clear_caches(aten.atan2.default)
    assert _info(aten.atan2.default) == (0, 0, 0)
    torch.atan2(t, t)
    assert _info(aten.atan2.default)[:2] == (1, 1)  # built again


def test_same_signature_is_a_cache_hit_new_shape_traces_again():
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    keys, traces, _ = _info(aten.atan2.default)
    torch.atan2(x.to(TPU), y.to(TPU))
    k1, t1, _ = _info(aten.atan2.default)
    assert (k1, t1) == (keys + 1, traces + 1)
    out = torch.atan2(x.to(TPU), y.to(TPU))
    assert _info(aten.atan2.default)[:2] == (k1, t1)  # hit: no new key, no new trace
    torch.testing.assert_close(out.cpu(), torch.atan2(x, y))
    torch.atan2(torch.randn(4).to(TPU), torch.randn(4).to(TPU))
    assert _info(aten.atan2.default)[:2] == (k1, t1 + 1)  # same key, jit retraces the shape


@pytest.fixture
def slow(monkeypatch):
    """The overloads of the calls that missed the fast path of CompiledCompute.__call__
    (each call of ``_call``, the full argument template), in order."""
    calls = []
    original = cached_compute.CompiledCompute._call
    monkeypatch.setattr(
        cached_compute.CompiledCompute,
        "_call",
        lambda self, *a, **k: calls.append(self.func) or original(self, *a, **k),
    )
    return calls


def test_new_tensors_take_the_fast_path_from_their_second_op(slow):
    # A new tensor's array is made lazily and read by its first op inside the compiled
    # path, which keeps it: the next op on it is a lookup by (dtype, size) alone.
    x, y = torch.randn(2, 3).to(TPU), torch.ones(2, 3, device=TPU)
    torch.atan2(x, y)
    n = len(slow)
    out = torch.atan2(x, y)
    assert len(slow) == n  # no slow-path call
    torch.testing.assert_close(out.cpu(), torch.atan2(x.cpu(), y.cpu()))
    y.add_(1)  # a write: the kept value is stale, the next op reads the storage again
    torch.testing.assert_close(torch.atan2(x, y).cpu(), torch.atan2(x.cpu(), y.cpu()))


def test_views_read_inside_take_the_fast_path_keyed_by_layout(slow):
    # x.t() @ w, x[:, i] * 2: a view not read yet enters the executable as its storage
    # (and its offset, where the read takes it as an argument); after the first call of
    # a layout, a lookup by (dtype, layout). Another offset of a dynamic-offset layout is
    # the same executable, another layout another one.
    base = torch.arange(40.0).reshape(5, 8)
    tpu = base.to(TPU)
    other = torch.randn(8, 5)
    other_tpu = other.to(TPU)
    tpu.t() + other_tpu  # first call of the transpose's layout
    tpu[:, 0] * 2  # first call of the column layout
    before = len(slow)
    got = [tpu.t() + other_tpu] + [tpu[:, i] * 2 for i in range(8)]
    want = [base.t() + other] + [base[:, i] * 2 for i in range(8)]
    assert len(slow) == before
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    # A write makes no view stale: it is read from the storage's new array.
    tpu.add_(1)
    before = len(slow)
    assert torch.equal((tpu[:, 3] * 2).cpu(), (base[:, 3] + 1) * 2)
    assert len(slow) == before


def test_recorded_values_take_the_fast_path_in_fused_mode(slow):
    # Inside torchjax.fused() an op's inputs are mostly values recorded, not run: they
    # are looked up by (dtype, size) as a value at hand is.
    x = torch.randn(4, 6)
    tpu = x.to(TPU)

    def chain(t):
        y = t * 2
        return (y.t() + 1).sum(0)

    for _ in range(2):
        with torchjax.fused():
            chain(tpu).cpu()
    before = len(slow)
    with torchjax.fused():
        got = chain(tpu)
    assert len(slow) == before
    assert torch.equal(got.cpu(), chain(tpu).cpu())  # fused is eager, bit for bit


def test_python_numbers_take_the_fast_path_keyed_by_type(slow):
    # x * 0.5, b + 1: after the first call, a lookup by the tensors' (dtype, size) and the
    # numbers' types; a number of another type is another executable (True, 1 and 1.0
    # promote differently), its value an argument.
    b = torch.tensor([True, False])
    i = torch.tensor([3, -4])
    cases = [(b, True), (b, 1), (b, 1.0), (i, 2), (i, 0.5), (i, True), (i, 2**40), (b, 1j)]
    for t, n in cases:
        tpu = t.to(TPU)
        tpu.add(n)  # the first call of each type builds the executable
        before = len(slow)
        for value in (n, n * 3 if not isinstance(n, bool) else False):
            got = tpu.add(value)
            want = t.add(value)
            assert got.dtype == want.dtype, (t.dtype, type(n))
            torch.testing.assert_close(got.cpu(), want)
        assert len(slow) == before, (t.dtype, type(n))


def test_static_arguments_take_the_fast_path_keyed_by_value(slow):
    # softmax(x, dim), layer_norm(x, shape, w, b, eps): the dim, the shape list and eps are
    # part of the fast key; another value is another executable, never the first one's.
    x = torch.randn(3, 4)
    w, b = torch.randn(4), torch.randn(4)
    calls = [
        lambda t, w, b: torch.softmax(t, -1),
        lambda t, w, b: torch.softmax(t, 0),
        lambda t, w, b: F.layer_norm(t, (4,), w, b, 1e-5),
        lambda t, w, b: F.layer_norm(t, (4,), w, b, 0.5),
        lambda t, w, b: F.layer_norm(t, (3, 4), None, None, 1e-5),
        lambda t, w, b: torch.sum(t, [0], keepdim=True),
        lambda t, w, b: torch.mean(t, [1]),
    ]
    tpu = [v.to(TPU) for v in (x, w, b)]
    for f in calls:
        f(*tpu)
    before = len(slow)
    for f in calls:
        got, want = f(*tpu), f(x, w, b)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want)
    assert len(slow) == before


def test_static_arguments_key_by_type_and_bits():
    # nan_to_num's nan is a ``float`` argument: static, keyed by its bits.
    x = torch.tensor([float("nan"), 1.0, -2.0])
    tx = x.to(TPU)
    before = _info(aten.nan_to_num.default)[0]
    for nan in (2.0, -0.0, 0.0):
        got = torch.nan_to_num(tx, nan=nan).cpu()
        want = torch.nan_to_num(x, nan=nan)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    # -0.0 and 0.0 are different keys (bits)
    assert _info(aten.nan_to_num.default)[0] == before + 3


def test_a_number_argument_keys_ints_by_value_and_passes_floats():
    # rsub's alpha: an int is static (2 is its own key), a float is an argument of one
    # executable whatever its value, -0.0 included (Note [Python floats as values of an
    # op's program]).
    x, y = torch.randn(4), torch.randn(4)
    tx, ty = x.to(TPU), y.to(TPU)
    before = _info(aten.rsub.Tensor)[0]
    for alpha in (2, 2.0, -0.0, 0.0, 3.5):
        torch.testing.assert_close(
            torch.rsub(tx, ty, alpha=alpha).cpu(), torch.rsub(x, y, alpha=alpha)
        )
    assert _info(aten.rsub.Tensor)[0] == before + 2


def test_promoted_python_scalar_is_an_argument_not_a_key():
    x = torch.randn(6)
    t = x.to(TPU)
    torch.mul(t, 0.5)
    keys, traces, _ = _info(aten.mul.Tensor)
    for s in (0.25, 3.0, -1.5):
        torch.testing.assert_close(torch.mul(t, s).cpu(), x * s)
    assert _info(aten.mul.Tensor)[:2] == (keys, traces)


def test_changing_float_static_argument_stops_compiling():
    x = torch.tensor([float("nan"), 1.0, float("inf")])
    tx = x.to(TPU)
    before = _info(aten.nan_to_num.default)[0]
    for i in range(3 * executables.MAX_FLOAT_VARIANTS):
        nan = 0.1 + i / 7
        assert torch.equal(torch.nan_to_num(tx, nan=nan).cpu(), torch.nan_to_num(x, nan=nan))
    assert _info(aten.nan_to_num.default)[0] - before <= executables.MAX_FLOAT_VARIANTS


def _calls(func):
    return torchjax.stats()["ops"].get(f"aten::{func._opname}.{func._overloadname}", {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_every_dtype_runs_as_one_cached_executable(dtype):
    # Made on the device: integer ops on values the host holds run there (Note [Integer
    # ops on host values]).
    x = torch.arange(1, 7).reshape(2, 3).to(dtype)
    t = torch.arange(1, 7, device=TPU).reshape(2, 3).to(dtype)
    torchjax.reset_stats()
    for _ in range(3):
        out = t * 3 + t
    s = torchjax.stats()
    assert _calls(aten.mul.Tensor) == {"calls": 3, "traces": 1, "keys": 1, "op_by_op": 0}
    assert _calls(aten.add.Tensor)["calls"] == 3 and _calls(aten.add.Tensor)["op_by_op"] == 0
    assert s["executions"] == 6 and s["cache_hits"] == 4 and s["host_reads"] == 0
    torch.testing.assert_close(out.cpu(), x * 3 + x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_trunc_division_compiled_equals_op_by_op_bit_for_bit(dtype, monkeypatch):
    # All finite half values (every exponent, subnormals included) against a shuffled copy.
    bits = np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.int16)
    a = torch.from_numpy(bits).view(dtype)
    a = a[torch.isfinite(a)]
    b = a[torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))]
    ta, tb = a.to(TPU), b.to(TPU)
    got = torch.div(ta, tb, rounding_mode="trunc").cpu()
    assert _calls(aten.div.Tensor_mode)["calls"] >= 1
    monkeypatch.setattr(executables, "MAX_FLOAT_VARIANTS", 0)  # new keys run op by op
    ta2, tb2 = a.to(TPU)[1:], b.to(TPU)[1:]  # views: a new key
    eager = torch.div(ta2, tb2, rounding_mode="trunc").cpu()
    assert torch.equal(got[1:].view(torch.int16), eager.view(torch.int16))


def test_index_checks_compile_and_raise_at_the_next_sync():
    w = torch.randn(3, 2, device=TPU)
    torch.tpu.synchronize()
    torchjax.reset_stats()
    e = F.embedding(torch.tensor([0, 9], device=TPU), w)  # no read, no raise here
    assert torchjax.stats()["ops"]["aten::embedding.default"]["op_by_op"] == 0
    assert torchjax.stats()["host_reads"] == 0
    with pytest.raises(IndexError, match=r"aten::embedding: index out of range.*index 9, 3 rows"):
        print(e)
    e.cpu()  # reported once


def test_random_ops_are_compiled_with_a_new_key_per_call():
    # Note [Compiled random ops]: one executable, the key an argument.
    x = torch.ones(1000, device=TPU)
    a, b = F.dropout(x, 0.5), F.dropout(x, 0.5)
    assert not torch.equal(a.cpu(), b.cpu())
    assert cached_compute.compilable(
        aten.native_dropout.default, _entry(aten.native_dropout.default)
    )
    info = cached_compute.cache_info(aten.native_dropout.default)
    assert info.calls >= 2 and info.op_by_op == 0


def _entry(func):
    from torchjax.ops import registry

    return registry._LOWERINGS.get(func) or registry.Lowering(lambda: None)


def test_concretization_in_a_lowering_falls_back_to_op_by_op():
    # aten::equal returns a Python bool computed from values: not traceable.
    x = torch.arange(4.0)
    assert torch.equal(x.to(TPU), x.to(TPU))
    assert not torch.equal(x.to(TPU), (x + 1).to(TPU))


def test_tracers_pass_through_compiled_lowerings():
    def fn(arr):
        t = torchjax.from_jax(arr)
        y = F.layer_norm(t, (8,)) + F.gelu(t) * 0.5
        return torchjax.to_jax(torch.softmax(y, -1))

    x = torch.randn(4, 8)
    got = jax.jit(fn)(jnp.asarray(x.numpy()))
    want = torch.softmax(F.layer_norm(x, (8,)) + F.gelu(x) * 0.5, -1)
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want)


@contextlib.contextmanager
def _no_host_reads():
    """Fail on any wait for, or read of, a jax array's value."""
    cls = type(jnp.zeros(()))

    def refuse(*args, **kwargs):
        raise AssertionError("a tpu op waited for or read device data")

    saved = {
        name: getattr(cls, name)
        for name in (
            "__array__",
            "block_until_ready",
            "item",
            "tolist",
            "__bool__",
            "__int__",
            "__float__",
        )
    }
    saved_fns = (jax.block_until_ready, jax.device_get)
    try:
        for name in saved:
            setattr(cls, name, refuse)
        jax.block_until_ready = jax.device_get = refuse
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
        jax.block_until_ready, jax.device_get = saved_fns


def test_eager_ops_do_not_wait_for_device_results():
    x = torch.randn(8, 16, device=TPU)
    w = torch.randn(16, device=TPU)
    q = torch.randn(1, 2, 8, 4, device=TPU)
    model = torch.nn.Linear(16, 4).to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    model(x).sum().backward()
    opt.step()  # compile outside the check
    _ = (x + x, x * 0.5, F.layer_norm(x, (16,), w), F.gelu(x), torch.softmax(x, -1), x @ x.T)
    _ = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with _no_host_reads():
        y = F.layer_norm(x + x * 0.5, (16,), w)
        y = torch.softmax(F.gelu(y), -1) @ x.T
        _ = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        opt.step()
        found_inf = torch.zeros((), device=TPU)
        torch._fused_adamw_(
            [p for p in model.parameters()],
            [p.grad for p in model.parameters()],
            [torch.zeros_like(p) for p in model.parameters()],
            [torch.zeros_like(p) for p in model.parameters()],
            [],
            [torch.ones((), device=TPU) for _ in model.parameters()],
            lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
            maximize=False, grad_scale=None, found_inf=found_inf,
        )  # fmt: skip
    assert y.cpu().shape == (8, 8)


_VIEWS = {
    "t": lambda w: w.t(),
    "transpose-slice": lambda w: w.transpose(0, 1)[1:5],
    "expand": lambda w: w[:1].expand(6, 6),
    "select-unsqueeze": lambda w: w.select(1, 2).unsqueeze(0).expand(6, 6),
    "diagonal": lambda w: w.diagonal().unsqueeze(1).expand(6, 6),
    "view": lambda w: w.reshape(3, 12).view(6, 6),
}


@pytest.mark.parametrize("make", list(_VIEWS.values()), ids=list(_VIEWS))
def test_layout_views_are_read_inside_the_consumer(make, monkeypatch):
    # Note [Lazy views]: t/transpose/slice/expand... compute nothing; the compiled op that
    # consumes the view reads it in its own executable. Values as CPU torch. (Earlier tests
    # may have used up mm's view keys; the cap is tested below.)
    monkeypatch.setattr(cached_compute, "MAX_VIEW_KEYS", 10**6)
    w, b = torch.randn(6, 6), torch.randn(6, 6)
    view = make(w.to(TPU))
    assert view._cache is None  # no value computed
    got = torch.mm(view, b.to(TPU))
    # Read inside mm's executable: nothing kept but, for a view that is its whole storage
    # in order, the storage's own array.
    assert view._cache is None or view._cache is view._storage.arr
    torch.testing.assert_close(got.cpu(), torch.mm(make(w), b))
    torch.testing.assert_close(view.cpu(), make(w))


def test_lazy_view_sees_later_writes_to_its_base():
    x = torch.zeros(4, 5, device=TPU)
    v = x.t()[1:3]
    x.add_(torch.arange(20.0).reshape(4, 5).to(TPU))
    w = x.cpu().t()[1:3]
    torch.testing.assert_close((v * 2).cpu(), w * 2)
    v.mul_(-1)  # a write through the lazy view reaches the base
    torch.testing.assert_close(x.cpu().t()[1:3], -w)


def test_fused_adamw_is_one_executable_across_steps_and_lr_changes():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    tpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    tpu.load_state_dict(cpu.state_dict())
    tpu.to(TPU)
    x = torch.randn(5, 4)
    for model, inp in ((cpu, x), (tpu, x.to(TPU))):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(4):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()
            sched.step()
    for t, c in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(t.detach().cpu(), c.detach(), rtol=1e-5, atol=1e-5)
    # every step (4 parameters, changing lr) ran the one executable for this shape set
    info = cached_compute.cache_info(aten._fused_adamw_.default)
    assert info.traces >= 1
    before = info.traces
    opt.step()
    assert info.traces == before


def test_foreach_adam_compiles_each_foreach_op_once():
    torch.manual_seed(0)
    cpu = torch.nn.Linear(6, 3)
    tpu = torch.nn.Linear(6, 3)
    tpu.load_state_dict(cpu.state_dict())
    tpu.to(TPU)
    x = torch.randn(4, 6)
    before = cached_compute.cache_info(aten._foreach_div_.ScalarList).keys
    for model, inp in ((cpu, x), (tpu, x.to(TPU))):
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
        for _ in range(6):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()
    for t, c in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(t.detach().cpu(), c.detach(), rtol=1e-5, atol=1e-5)
    # the per-step bias corrections are arguments: at most one new key for six steps
    assert cached_compute.cache_info(aten._foreach_addcdiv_.ScalarList).keys >= 1
    assert cached_compute.cache_info(aten._foreach_div_.ScalarList).keys - before <= 1


def test_views_of_many_layouts_stop_adding_keys():
    # A growing KV cache gives a new view layout every step: past MAX_VIEW_KEYS the view
    # is read first and the op keeps one plain key (and stays compiled).
    cache = torch.randn(1, 40, 8)
    tcache = cache.to(TPU)
    keys0, _, eager0 = _info(aten.tanh.default)
    for n in range(1, cached_compute.MAX_VIEW_KEYS + 8):
        got = torch.tanh(tcache[:, :n])
        torch.testing.assert_close(got.cpu(), torch.tanh(cache[:, :n]))
    keys, _, eager = _info(aten.tanh.default)
    assert keys - keys0 <= cached_compute.MAX_VIEW_KEYS + 1
    assert eager == eager0


def _view_limits(func):
    """(view keys counted, input signatures counted) of ``func``'s compiled paths."""
    owners = [o for o in list(executables._OWNERS) if hasattr(o, "view_keys") and o.func == func]
    assert owners
    return (
        sum(o.view_keys for o in owners),
        sum(len(v) for o in owners for v in o.view_signatures.seen.values()),
    )


@pytest.mark.parametrize("captured", [False, True])
def test_views_keyed_in_a_captured_trace_are_not_counted(captured):
    # Note [Captured traces leave the view limits alone] (torchjax/ops/fused_nodes.py):
    # the ops of a captured call's trace take the decisions eager's counts give and add
    # nothing to them; another trace (torchjax.jit) counts as eager does.
    def read(arr, pred):
        with fused_nodes.tracing(pred if captured else None):
            return torch.tanh(wrap(arr)[:, 1:3])._value()

    torch.tanh(torch.ones(2).to(TPU))  # its compiled path made (no view)
    before = _view_limits(aten.tanh.default)
    with x64(True):
        jaxpr = jax.make_jaxpr(read)(jnp.ones((4, 6)), np.bool_(True))
    assert "tanh" in str(jaxpr)
    added = 0 if captured else 1
    assert _view_limits(aten.tanh.default) == (before[0] + added, before[1] + added)


def test_a_view_beside_a_growing_argument_shares_the_plain_executables():
    # cat([cache, new.transpose(1, 2)]) of a growing KV cache: the view's layout is fixed,
    # the cache grows. Past MAX_VIEW_SIGNATURES lengths the view is read first, so the
    # cat of the view and the cat of a plain tensor of its shape share one executable
    # per length (Note [Views in keys whose shapes vary]); values are exact.
    new = torch.randn(1, 1, 2, 4)
    tnew = new.to(TPU)
    plain = torch.randn(1, 2, 1, 4)
    tplain = plain.to(TPU)
    cache = torch.randn(1, 2, 3, 4)
    tcache = cache.to(TPU)
    traces = []
    for _ in range(cached_compute.MAX_VIEW_SIGNATURES + 4):
        before = cached_compute.cache_info(aten.cat.default).traces
        cat_v = torch.cat([tcache, tnew.transpose(1, 2)], dim=-2)
        cat_p = torch.cat([tcache, tplain], dim=-2)
        traces.append(cached_compute.cache_info(aten.cat.default).traces - before)
        assert torch.equal(cat_v.cpu(), torch.cat([cache, new.transpose(1, 2)], dim=-2))
        assert torch.equal(cat_p.cpu(), torch.cat([cache, plain], dim=-2))
        cache, tcache = torch.cat([cache, plain], dim=-2), cat_p
    n = cached_compute.MAX_VIEW_SIGNATURES
    assert traces[:n] == [2] * n  # the view read inside: its own executable per length
    assert traces[n:] == [1] * (len(traces) - n)  # one shared executable per length
    assert cached_compute.cache_info(aten.cat.default).op_by_op == 0


def test_reads_of_a_growing_batch_share_one_program_per_length():
    # generate's ids of a batch, one token longer each step: ``ids[:, -1:]`` has the
    # length as its row stride, a new layout every step. Past MAX_VIEW_SIGNATURES
    # lengths the ops on it read the view first: the read is one program per length,
    # shared by every op reading that column, and each op keeps one plain executable
    # (Note [Views in keys whose shapes vary]); values are exact.
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    # Made on the device: integer ops on values the host holds run there (Note [Integer
    # ops on host values]).
    tids = torch.arange(1, 7, device=TPU).reshape(2, 3)
    eos = torch.tensor([7])
    teos = eos.to(TPU)
    mul, isin = [], []
    for step in range(8):
        m0 = cached_compute.cache_info(aten.mul.Tensor).traces
        i0 = cached_compute.cache_info(aten.isin.Tensor_Tensor).traces
        got = (tids[:, -1:] * 3, torch.isin(tids[:, -1:], teos))
        mul.append(cached_compute.cache_info(aten.mul.Tensor).traces - m0)
        isin.append(cached_compute.cache_info(aten.isin.Tensor_Tensor).traces - i0)
        assert torch.equal(got[0].cpu(), ids[:, -1:] * 3)
        assert torch.equal(got[1].cpu(), torch.isin(ids[:, -1:], eos))
        new = torch.tensor([[step], [step + 7]])
        ids, tids = torch.cat([ids, new], -1), torch.cat([tids, new.to(TPU)], -1)
    # The first lengths read the column inside the op's program; then one plain
    # executable per op, traced once.
    n = cached_compute.MAX_VIEW_SIGNATURES
    assert mul[n:] == isin[n:] == [1] + [0] * (7 - n), (mul, isin)


def test_ops_on_views_at_many_offsets_trace_once():
    # ``t[:, i]`` over a loop: the view's offset is an argument of the op's executable
    # (Note [View offsets as arguments]), not part of its key.
    x = torch.randn(2, 40, 3)
    t = x.to(TPU)
    torchjax.reset_stats()
    for i in range(0, 40, 3):
        torch.testing.assert_close((t[:, i] * 2.5).cpu(), x[:, i] * 2.5)
    mul = _calls(aten.mul.Tensor)
    assert mul["calls"] == 14 and mul["traces"] == 1 and mul["op_by_op"] == 0


def test_lists_of_tensors_take_the_fast_path(slow):
    # cat's inputs and index lists: after the first call of a signature, a lookup by each
    # tensor's (dtype, size), None entries kept; equal to CPU, results and writes.
    base = torch.arange(24.0).reshape(4, 6)
    idx, rows, cols = torch.tensor([2, 0, 3]), torch.tensor([1, 1]), torch.tensor([5, 0])
    vals = torch.tensor([-1.0, -2.0, -3.0])

    def calls(t, i, r, c, v):
        w = t.clone()
        w.index_put_((i,), v.unsqueeze(1).expand(3, 6).contiguous())
        return [
            torch.cat([t, t * 2], 0),
            torch.stack((t, t + 1)),
            t[i],
            t[:, i],
            t[r, c],
            w,
        ]

    tpu = [a.to(TPU) for a in (base, idx, rows, cols, vals)]
    for t in tpu:
        t + 0  # each value at hand
    calls(*tpu)
    before = len(slow)
    got = calls(*tpu)
    fast = len(slow) - before
    want = calls(base, idx, rows, cols, vals)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g.cpu(), w)
    # No list takes the template (the clone and the expanded view may).
    assert aten.cat.default not in slow[before:] and aten.stack.default not in slow[before:]
    assert aten.index.Tensor not in slow[before:], slow[before:]
    assert aten.index_put_.default not in slow[before:], slow[before:]
    assert fast < 6


def test_a_mask_or_a_view_in_an_index_list_takes_the_template(slow):
    base = torch.arange(12.0).reshape(3, 4)
    tpu = base.to(TPU)
    mask = torch.tensor([True, False, True])
    cols = torch.tensor([[3, 1], [0, 2]])
    for _ in range(2):
        got_mask = tpu[mask.to(TPU)]
        got_view = tpu[:, cols.to(TPU).t()]
    assert torch.equal(got_mask.cpu(), base[mask])
    assert torch.equal(got_view.cpu(), base[:, cols.t()])


def test_reads_of_a_growing_storage_share_one_program_per_length():
    # Note [Views of a growing storage]: generate's loop appends a token to the ids, then
    # reads the last one as the model's input, in the end-of-sequence check (isin) and for
    # the next position (+ 1). After two lengths the three share one read program per
    # length; with the cat, two compiles per token (a key per length compiled isin's
    # comparison and the add with the read fused in, per length: four). One row, as in a
    # one-prompt generate: with more rows the view's row stride is the length, a new key.
    ids = torch.arange(7, dtype=torch.int16).reshape(1, 7)  # shapes no other test uses
    eos = torch.tensor([3, 11], dtype=torch.int16)
    t_ids, t_eos = ids.to("tpu"), eos.to("tpu")
    per_step = []
    for step in range(10):
        token = (ids[:, -1:] * 3 + step) % 50
        t_token = token.to("tpu")
        before = torchjax.stats()["compiles"]
        t_ids = torch.cat([t_ids, t_token], dim=-1)
        got = (t_ids[:, -1:].clone(), torch.isin(t_ids[:, -1:], t_eos), t_ids[:, -1:] + 1)
        per_step.append(torchjax.stats()["compiles"] - before)
        ids = torch.cat([ids, token], dim=-1)
        want = (ids[:, -1:].clone(), torch.isin(ids[:, -1:], eos), ids[:, -1:] + 1)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
    assert max(per_step[4:]) <= 2, per_step
