"""Op families on the chip against CPU torch: one ``torchjax.jit`` program per family at
a small and a tile-sized shape, eager at the larger; the three float32 matmul precision
settings; dtypes XLA:TPU emulates (int64, float64); RNG; views and in-place; autocast.

Tolerances: XLA:TPU's float32 transcendental functions and reduction orders are not
glibc's and ATen's, a few units in the last place (rtol 2e-5); matmuls at torch's default
"highest" precision are float32-exact to 1e-5 of the result's scale.
"""

from __future__ import annotations

import os

import jax
import pytest
import torch
import torch.nn.functional as F

import torchjax

# Measured on a v5e: XLA:TPU's float32 log is within 7.4e-5 (absolute) of glibc's near 1.
TOL = dict(rtol=1e-4, atol=1e-4)
SHAPES = [(8, 16), (256, 512)]


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    y = torch.rand(shape, generator=g) + 0.5  # positive: a divisor, a log argument
    idx = torch.randint(0, shape[0], (shape[0] // 2,), generator=g)
    return x, y, idx


def _pointwise(x, y, idx):
    return [
        x.exp(), x.tanh(), torch.sigmoid(x), x.sin(), y.log(), y.sqrt(), y.rsqrt(),
        torch.erf(x), x.abs(), x * y + 2, x / y, torch.atan2(x, y), x.clamp(-0.5, 0.5),
        torch.where(x > 0, x, y), x.pow(2), y.pow(0.3), torch.floor(x * 3), x.sign(),
        torch.maximum(x, y), x.round(decimals=1), torch.lerp(x, y, 0.3), x > y,
    ]  # fmt: skip


def _reduction(x, y, idx):
    return [
        x.sum(1), x.mean(0), x.amax(1), x.amin(0), x.var(1), x.std(0), x.prod(1) * 0,
        torch.logsumexp(x, 1), x.argmax(1), x.argmin(0), x.cumsum(1), x.cumprod(1) * 0,
        x.norm(dim=1), (x > 0).sum(1), (x > 0).any(1), x.sum(),
    ]  # fmt: skip


def _activation_norm(x, y, idx):
    w, b = y[0], x[0]
    return [
        F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x), F.softmax(x, 1),
        F.log_softmax(x, 1), F.relu(x), F.elu(x), F.softplus(x),
        F.layer_norm(x, (x.shape[1],), w, b), F.rms_norm(x, (x.shape[1],), w),
        F.group_norm(x.reshape(x.shape[0], 4, -1), 2),
        F.normalize(x, dim=1), F.cross_entropy(x, idx.repeat(2)[: x.shape[0]] % x.shape[1]),
    ]  # fmt: skip


def _indexing_shape(x, y, idx):
    n, cols = x.shape[0], idx % x.shape[1]
    rows = idx[:, None].expand(-1, x.shape[1])
    return [
        x[idx], x.index_select(1, cols), x.gather(1, cols.repeat(2)[:n, None]),
        x.index_add(0, idx, y[: idx.shape[0]]), x.scatter_add(0, rows, y[: idx.shape[0]]),
        x.masked_fill(x > 0, 0.5), x.t().contiguous(), x.reshape(-1, 4).flip(0),
        torch.cat([x, y], 1), torch.stack([x, y]).sum(0), x.roll(3, 1), torch.tril(x),
        x.repeat(2, 1), x.unfold(1, 4, 4).sum(-1), x.sort(1)[0], x.sort(dim=1, stable=True)[1],
        x.topk(3, 1)[0], x.topk(3, 1)[1], x.diff(dim=1), F.pad(x, (1, 2)),
    ]  # fmt: skip


def _data_dependent(x, y, idx):
    # Output shapes set by values: eager only (a trace refuses them, DataDependentError).
    return [torch.nonzero(x > 1.5), x[x > 1], torch.unique(idx), x.masked_select(y > 1)]


def _conv_pool(x, y, idx):
    img = x.reshape(2, -1, 4, x.shape[1] // 4)[:, :4]
    c = img.shape[1]
    w = y.reshape(-1).repeat(2)[: c * c * 9].reshape(c, c, 3, 3)
    return [
        F.conv2d(img, w, padding=1), F.max_pool2d(img, 2), F.avg_pool2d(img, 2),
        F.adaptive_avg_pool2d(img, 1), F.interpolate(img, scale_factor=2, mode="bilinear"),
        F.conv1d(x[None, :4], w[:, :, 0, :].reshape(c, c, 3)[:4, :4], padding=1),
    ]  # fmt: skip


FAMILIES = {
    "pointwise": _pointwise,
    "reduction": _reduction,
    "activation_norm": _activation_norm,
    "indexing_shape": _indexing_shape,
    "conv_pool": _conv_pool,
    "data_dependent": _data_dependent,
}


def _close(got, want, **tol):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device.type == "tpu", i
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape)
        torch.testing.assert_close(g.cpu(), w, msg=lambda m, i=i: f"output {i}: {m}", **tol)
    return len(got)


@pytest.mark.parametrize("shape", SHAPES, ids=["8x16", "256x512"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_eager_and_jitted_match_cpu(family, shape):
    fn = FAMILIES[family]
    cpu_in = _inputs(shape)
    tpu_in = [t.to("tpu") for t in cpu_in]
    want = fn(*cpu_in)
    # Each eager op is a program compiled for the chip: eager at one shape, jitted at both.
    if shape == SHAPES[-1] or family == "data_dependent":
        assert _close(fn(*tpu_in), want, **TOL) > 0
    if family != "data_dependent":
        assert _close(torchjax.jit(fn)(*tpu_in), want, **TOL) > 0


# The precision settings (Note [Matmul precision]): relative error of a 512x512 product
# and a convolution against float64, measured on a v5e: highest 1.2e-7, high 1.2e-5,
# medium 2.4e-3. The bounds leave a factor of about 10.
PRECISION_BOUND = {"highest": 2e-6, "high": 2e-4, "medium": 3e-2}


@pytest.mark.parametrize("setting", list(PRECISION_BOUND))
def test_float32_matmul_precision_settings(setting):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    img, w = torch.randn(2, 16, 32, 32, generator=g), torch.randn(32, 16, 3, 3, generator=g)
    exact = [a.double() @ b.double(), F.conv2d(img.double(), w.double(), padding=1)]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        got = [a.to("tpu") @ b.to("tpu"), F.conv2d(img.to("tpu"), w.to("tpu"), padding=1)]
    finally:
        torch.set_float32_matmul_precision(before)
    for g_, e in zip(got, exact):
        err = ((g_.cpu().double() - e).norm() / e.norm()).item()
        assert err < PRECISION_BOUND[setting], (setting, err)
    if setting == "highest":
        torch.testing.assert_close(got[0].cpu(), a @ b, rtol=1e-5, atol=1e-4)


def test_bfloat16_and_float16_products_accumulate_in_float32():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 1024, generator=g), torch.randn(1024, 128, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        want = a.to(dtype) @ b.to(dtype)  # CPU: float32 accumulation, one rounding
        got = (a.to(dtype).to("tpu") @ b.to(dtype).to("tpu")).cpu()
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_dtypes_xla_tpu_emulates_keep_their_values(monkeypatch):
    # int64 past 2**31 is emulated exactly on the chip; float64 keeps about 48 bits, inside
    # float32's exponent range only, which the first float64 tensor says (Note [float64
    # on TPU]), as measured on a v5e: 1e30 * 3 is 3e-15 from CPU's, 1e-30 * 3 3.2e-9 (the
    # pair's low word underflows), 1e-300 * 3 is 0.
    import warnings

    from torchjax.tensor import _tensor, dtypes

    big = torch.tensor([2**40 + 3, -(2**35), 7], dtype=torch.int64)
    t = big.to("tpu")
    assert t.dtype == torch.int64
    assert torch.equal((t * 3 + 1).cpu(), big * 3 + 1)
    assert torch.equal((t // 5).cpu(), big // 5)
    assert torch.equal(t.cumsum(0).cpu(), big.cumsum(0))
    monkeypatch.setattr(dtypes, "_WARNED", set())
    monkeypatch.setattr(_tensor, "_CONTIGUOUS_META", {})
    x = torch.tensor([1 / 3, 2.0**60 + 1, 1e30, 1e-30], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = (x.to("tpu") * 3).cpu()
    emulated = jax.default_backend() in dtypes.EMULATED_FLOAT64
    assert emulated == any("float32's exponent range" in str(w.message) for w in seen)
    assert got.dtype == torch.float64
    # 2**-48 is 3.6e-15: the pair's 48 bits; 1e-30's low word lies below float32's normals
    rtol = (8e-15, 1e-8) if emulated else (1e-15, 1e-15)
    torch.testing.assert_close(got[:3], x[:3] * 3, rtol=rtol[0], atol=0)
    torch.testing.assert_close(got[3:], x[3:] * 3, rtol=rtol[1], atol=0)
    assert (got[3] - x[3] * 3).abs() / (x[3] * 3) < 1e-6  # still far closer than float32
    torch.testing.assert_close(x[:3].to("tpu").sum().cpu(), x[:3].sum(), rtol=rtol[0], atol=0)
    outside = torch.tensor([1e-300, 1e300], dtype=torch.float64)
    want = torch.tensor([0.0, float("inf")], dtype=torch.float64) if emulated else outside * 3
    assert torch.equal((outside.to("tpu") * 3).cpu(), want)


def test_integer_scans_by_the_chips_form_keep_cpus_values():
    # Note [Integer scans by platform]: integer cumsum/cumprod scan by
    # lax.associative_scan on the chip. The inputs are made on the device: a small tensor
    # copied from the host keeps host values, and its integer cumsum runs CPU's kernel
    # (Note [Integer ops on host values]).
    def scans(x, mask):
        return [
            x.cumsum(-1), x.cumprod(-1), x.cumsum(0, dtype=torch.int32),
            x.cumprod(-1, dtype=torch.int8), mask.long().cumsum(-1), mask.cumprod(-1),
            x.flip(-1).cumsum(-1),
        ]  # fmt: skip

    cpu = torch.arange(-1000, 1048).reshape(2, 1024) * (2**40 + 3)
    dev = torch.arange(-1000, 1048, device="tpu").reshape(2, 1024) * (2**40 + 3)
    torchjax.reset_stats()
    for got in (scans(dev, dev % 3 != 0), torchjax.jit(scans)(dev, dev % 3 != 0)):
        want = scans(cpu, cpu % 3 != 0)
        assert len(got) == len(want) == 7
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
    assert torchjax.stats()["host_ops"] == 0


def test_rng_streams_reproduce_and_differ():
    torch.manual_seed(123)
    a = torch.rand(4096, device="tpu")
    n = torch.randn(4096, device="tpu")
    torch.manual_seed(123)
    b = torch.rand(4096, device="tpu")
    assert torch.equal(a.cpu(), b.cpu())
    c = torch.rand(4096, device="tpu")
    assert not torch.equal(b.cpu(), c.cpu())
    assert abs(a.mean().item() - 0.5) < 0.03 and abs(n.std().item() - 1) < 0.05
    state = torch.tpu.get_rng_state()
    d = torch.randn(16, device="tpu")
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.randn(16, device="tpu").cpu(), d.cpu())
    # A CPU generator gives CPU's own draws on tpu (Note [CPU generators on tpu]).
    cpu = torch.randn(64, generator=torch.Generator().manual_seed(5))
    tpu = torch.randn(64, device="tpu", generator=torch.Generator().manual_seed(5))
    assert torch.equal(tpu.cpu(), cpu)
    # Dropout masks differ from call to call under one jitted program (the key is an input).
    drop = torchjax.jit(lambda x: F.dropout(x, 0.5, training=True))
    ones = torch.ones(4096, device="tpu")
    m1, m2 = drop(ones).cpu(), drop(ones).cpu()
    assert not torch.equal(m1, m2) and abs((m1 == 0).float().mean().item() - 0.5) < 0.05


def test_views_and_in_place_writes_alias_as_on_cpu():
    def run(device):
        x = torch.arange(24.0).reshape(4, 6).to(device)
        x[0].add_(1)  # through a view
        v = x.view(2, 12)
        v[1, 3:5] = -1  # slice assignment seen by x
        cache = torch.zeros(2, 3, 8, 4, device=device)
        cache[:, :, 5] = torch.ones(2, 3, 4, device=device)  # a KV-cache write
        t = x.t()
        t.mul_(2)
        y = torch.empty(4, 6, device=device)
        torch.add(x, 1, out=y)
        z = x.clone()
        z.index_put_(
            (torch.tensor([0, 0, 3], device=device),), torch.ones(6, device=device), accumulate=True
        )
        u = x.unsqueeze(0)
        u.unsqueeze_(0)
        x.data = x.data * 3  # .data assignment
        return [x, v, cache.sum((0, 1)), t, y, z, u]

    cpu, tpu = run("cpu"), run("tpu")
    for c, t in zip(cpu, tpu):
        assert t.shape == c.shape and t.stride() == c.stride()
        torch.testing.assert_close(t.cpu(), c)


def test_autocast_bfloat16_follows_cudas_policy_with_cpus_values():
    # torch.autocast("tpu") takes CUDA's op lists (torchjax/device/_autocast.py): a linear in
    # bfloat16, softmax in float32. The same casts on CPU give the values to match.
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(256, 128)
    x = torch.randn(64, 256, generator=g)
    h = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    want = [h, F.softmax(h.float(), -1)]
    lin_t = lin.to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        ht = lin_t(x.to("tpu"))
        got = [ht, F.softmax(ht, -1)]
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32]
    for t, w in zip(got, want):
        torch.testing.assert_close(t.cpu(), w, rtol=1.6e-2, atol=1e-2)


def test_the_suites_cpu_compile_flags_did_not_reach_the_chip():
    # Note [The TPU tier]: the chip compiles at XLA's defaults; a CPU run keeps the flags.
    from tests.conftest import _FAST_COMPILE

    flags = os.environ.get("XLA_FLAGS", "")
    present = [f for f in _FAST_COMPILE if f in flags]
    assert present == ([] if jax.default_backend() == "tpu" else list(_FAST_COMPILE)), flags
