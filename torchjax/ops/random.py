"""Random ops: in-place samplers (normal_, uniform_, random_, ...) and the ``*_like``
random factories (randperm and multinomial are in ops/random_indices.py; dropout, which
draws the same way, is in ops/dropout.py).

Every draw takes a fresh key from the per-device RNG state (torchjax/tensor/random.py,
``next_key``), so ``torch.manual_seed`` makes tpu randomness reproducible,
``torch.tpu.get_rng_state``/``set_rng_state`` replay it and no two draws share a key.
The key is drawn in eager, on the device holding the op's first tensor; values differ
from CPU torch's (a different generator), so tests check shapes, ranges and statistics.
While jax is tracing (no concrete device), the key comes from tpu:0's state at trace
time and is a constant of the traced graph: torchjax.jit must thread keys in itself (see
``_key``), as design.md requires.

Note [CPU generators on tpu]
``torch.Generator(device="tpu")`` cannot be created: torch asks the backend's C++
``PrivateUse1HooksInterface::getNewGenerator``, which a pure-Python backend cannot
register, and raises its own NotImplementedError from C++, before torchjax runs (see
README, "Randomness"). Replacing ``torch.Generator`` with a subclass that makes one was
tried and dropped: it changes CPU code (``type(g) is torch.Generator``, user subclasses
of torch.Generator, TorchScript of code that makes a generator or annotates with an
alias taken earlier). A ``generator=`` reaching a tpu op is therefore a CPU generator.
torch refuses one for a CUDA tensor, but there a CUDA generator exists; here the CPU
generator is the only way to seed one draw, which diffusers (``randn_tensor``, its
schedulers) and transformers' init functions rely on. So in eager mode a tpu random op
with a CPU generator runs on CPU tensors of the same layout, from that generator (the
same values, and the same generator advance, as the op on a CPU tensor), and its result
goes to the tpu tensors (Note [CPU draws keep the layout] in
torchjax/ops/_cpu_generator.py: the lowerings here never see a generator). Under
torchjax.jit it raises: a CPU draw would be a constant of the trace.

Data-dependent checks (bernoulli's ``p`` in [0, 1], multinomial's distribution) are
device checks, raised at the next sync (Note [Device-side checks]). Each op is a cached
executable taking its key as an argument (Note [Compiled random ops] in
torchjax/ops/_seeded.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops.registry import handler, lowering
from torchjax.ops.writeback import dtype_name, write_into
from torchjax.tensor import dtypes
from torchjax.tensor import random as _rng
from torchjax.tensor._tensor import wrap

aten = torch.ops.aten

_DEVICE_INDEX: dict = {}


def _key(x) -> jax.Array:
    """A fresh key for one draw on the device holding ``x`` (device 0 while tracing:
    torchjax.jit threads keys in through torchjax/tensor/random.py)."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return _rng.next_key(0)
    devs = x.devices()
    if len(devs) != 1:  # sharded over a mesh: one stream for the whole array, tpu:0's
        return _rng.next_key(0)
    dev = next(iter(devs))
    index = _DEVICE_INDEX.get(dev)
    if index is None:
        index = _DEVICE_INDEX[dev] = jax.devices().index(dev)
    return _rng.next_key(index)


def _check_float(op: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise RuntimeError(
            f"aten::{op} expects a floating point tensor, got {dtypes.to_torch_dtype(x.dtype)}"
        )


def _opmath(dtype):
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _check_float_or_complex(op: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise RuntimeError(
            f"aten::{op} expects a floating point or complex tensor, got "
            f"{dtypes.to_torch_dtype(x.dtype)}"
        )


def _fill_real_view(self, draw):
    """``draw(shape, real_dtype)`` for a real tensor; for a complex one, ATen samples its
    ``view_as_real`` (real and imaginary parts drawn independently), so do we."""
    if not jnp.issubdtype(self.dtype, jnp.complexfloating):
        return draw(self.shape, _opmath(self.dtype)).astype(self.dtype)
    real = jnp.finfo(self.dtype).dtype
    parts = draw((*self.shape, 2), real)
    return lax.complex(parts[..., 0], parts[..., 1]).astype(self.dtype)


def _round_down(x, dtype):
    """float32 ``x`` in the half type ``dtype``, rounded toward -inf (never above ``x``)."""
    h = x.astype(dtype)
    return jnp.where(h.astype(x.dtype) > x, jnp.nextafter(h, jnp.asarray(-jnp.inf, dtype)), h)


def _half_at_least(value: float, dtype) -> np.ndarray:
    """The least value of the half type ``dtype`` that is >= ``value`` (on the host)."""
    h = np.asarray(value, dtype=dtype)  # to nearest
    if float(h) >= value:
        return h
    if float(h) == 0:
        h = np.zeros((), dtype=dtype)
    bits = h.view(np.uint16)
    # One step up: a larger magnitude for a positive value, a smaller for a negative one.
    return (bits + np.uint16(1) if float(h) >= 0 else bits - np.uint16(1)).view(dtype)


def _uniform01(key, shape, dtype):
    """Uniform in [0, 1) in ``_opmath(dtype)``. For f16/bf16 drawn in float32 and rounded
    down to the half type, as CPU's draws stay below 1 (rounded to nearest, one bfloat16
    draw in 500 was 1.0: ``log(1 - u)`` infinite, ``randint`` past its bound)."""
    if dtype not in (jnp.float16, jnp.bfloat16):
        return jax.random.uniform(key, shape, dtype=dtype)
    return _round_down(jax.random.uniform(key, shape, dtype=jnp.float32), dtype).astype(jnp.float32)


# ---------------------------------------------------------------------------------------
# in-place samplers


@lowering(aten.uniform_.default, aten.uniform.default, self_values=False, cpu_generator=True)
def uniform(self, from_=0.0, to=1.0, *, generator=None, **kw):
    """aten::uniform_ - fill with U[from, to).

    Dtypes: floating and complex (torch raises for integers); a complex tensor gets real
    and imaginary parts each in [from, to). f16/bf16 drawn in float32 and rounded down,
    so a draw stays below ``to`` as CPU's do (rounded to nearest, it reached ``to``).
    Reference: torch.Tensor.uniform_ (ATen uniform_impl_).
    """
    from_ = kw.pop("from", from_)  # "from" is a Python keyword: by position or in **kw
    _check_float_or_complex("uniform_", self)
    real = jnp.finfo(self.dtype).dtype  # a complex tensor draws its real view
    top = float(jnp.finfo(real).max)
    for value, what in ((from_, "from"), (to, "to")):
        if not -top <= value <= top:  # ATen's CHECK_OUT_OF_BOUNDS, infinities included
            name = dtype_name(dtypes.to_torch_dtype(real))
            raise RuntimeError(f"{what} is out of bounds for {name} (in aten::uniform_)")
    if not from_ <= to:
        raise RuntimeError(
            f"uniform_ expects to return a [from, to) range, but found "
            f"from={from_} > to={to} (in aten::uniform_)"
        )
    if to - from_ > top:
        name = dtypes.aten_type_name(dtypes.to_torch_dtype(real))
        raise RuntimeError(
            f"uniform_ expects to-from <= std::numeric_limits<{name}>::max(), but found "
            f"to={to:g} and from={from_:g} which result in to-from to exceed the limit"
        )
    key = _key(self)
    if self.dtype in (jnp.float16, jnp.bfloat16):
        # In float32, rounded down: below ``to`` as on CPU (Note on _uniform01).
        x = jax.random.uniform(key, self.shape, dtype=jnp.float32)
        out = _round_down(x * (np.float32(to) - np.float32(from_)) + np.float32(from_), self.dtype)
        # Never below ``from``: a bound between two half values is rounded up first.
        return jnp.maximum(out, _half_at_least(from_, self.dtype))
    return _fill_real_view(
        self, lambda shape, ct: jax.random.uniform(key, shape, dtype=ct, minval=from_, maxval=to)
    )


@lowering(
    aten.normal_.default,
    aten.normal_functional.default,
    self_values=False,
    cpu_generator=True,
)
def normal_(self, mean=0.0, std=1.0, *, generator=None):
    """aten::normal_ - fill with N(mean, std**2). Dtypes: floating and complex; a complex
    tensor gets real and imaginary parts each N(mean, std**2 / 2), so E|z - mean|^2 = std**2
    (torch.randn's complex convention).
    Reference: torch.Tensor.normal_ (ATen normal_impl_)."""
    _check_float_or_complex("normal_", self)
    _check_std("normal_", std)
    key = _key(self)
    scale = std / math.sqrt(2) if jnp.issubdtype(self.dtype, jnp.complexfloating) else std
    return _fill_real_view(
        self, lambda shape, ct: jax.random.normal(key, shape, dtype=ct) * scale + mean
    )


@handler(aten.normal.out, cpu_generator=True)
def normal_out(args, kwargs):
    """aten::normal.out - normal_functional's out=: N(mean, std**2) of ``self``'s shape
    written into ``out`` (resized as out= is). Not the registry's out= path: torch's meta
    kernel for this overload refuses every call ("normal expects mean and std to be
    scalars when size is defined"). With a CPU generator the call runs on CPU, which draws
    into a clone of ``self``, in its layout (Note [CPU draws keep the layout])."""
    self, out = args[0], kwargs["out"]
    mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
    std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
    arr = jnp.zeros(tuple(self.shape), dtype=dtypes.to_jax_dtype(out.dtype))
    write_into(aten.normal.out, out, wrap(arr, out._device_index), resize=True)
    return out.normal_(mean, std)


def _check_std(op, std):
    if not isinstance(std, jax.Array):
        if not std >= 0:  # NaN too, as CPU
            raise RuntimeError(f"normal expects std >= 0.0, but found std {std} (in aten::{op})")
        return
    bad = jnp.any(~(std >= 0))
    if not isinstance(bad, jax.core.Tracer):
        if bool(bad):
            raise RuntimeError(f"normal expects all elements of std >= 0.0 (in aten::{op})")
        return
    # Inside a compiled lowering: CPU and CUDA both read the check at the op.
    _checks.require(
        bad, jnp.zeros((), std.dtype), RuntimeError,
        f"normal expects all elements of std >= 0.0 (in aten::{op})", deferred=False,
    )  # fmt: skip


def _normal(op, mean, std):
    _check_std(op, std)
    like = mean if isinstance(mean, jax.Array) else std
    if not jnp.issubdtype(like.dtype, jnp.floating):
        raise RuntimeError(
            f"aten::{op}: normal expects floating point mean/std, got "
            f"{dtypes.to_torch_dtype(like.dtype)}"
        )
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    ct = _opmath(like.dtype)
    z = jax.random.normal(_key(like), shape, dtype=ct)
    return (z * jnp.asarray(std, ct) + jnp.asarray(mean, ct)).astype(like.dtype)


@lowering(aten.normal.Tensor_float, cpu_generator=True)
def normal_tensor_float(mean, std=1.0, *, generator=None):
    """aten::normal.Tensor_float - N(mean[i], std**2); shape and dtype of ``mean``."""
    return _normal("normal.Tensor_float", mean, std)


@lowering(aten.normal.float_Tensor, cpu_generator=True)
def normal_float_tensor(mean, std, *, generator=None):
    """aten::normal.float_Tensor - N(mean, std[i]**2); shape and dtype of ``std``."""
    return _normal("normal.float_Tensor", mean, std)


@lowering(aten.normal.Tensor_Tensor, cpu_generator=True)
def normal_tensor_tensor(mean, std, *, generator=None):
    """aten::normal.Tensor_Tensor - N(mean[i], std[i]**2); broadcast shape, mean's dtype."""
    return _normal("normal.Tensor_Tensor", mean, std)


@lowering(aten.bernoulli_.float, aten.bernoulli.p, self_values=False, cpu_generator=True)
def bernoulli_p(self, p=0.5, *, generator=None):
    """aten::bernoulli_.float / bernoulli.p - 1 with probability ``p`` else 0, in
    ``self``'s dtype and shape. Reference: torch.Tensor.bernoulli_."""
    if not 0 <= p <= 1:
        raise RuntimeError(
            f"bernoulli_ expects p to be in [0, 1], but got p={p} (in aten::bernoulli_.float)"
        )
    return _bernoulli_mask(_key(self), self.shape, p).astype(self.dtype)


# Note [One Bernoulli draw]
# ``bernoulli_(p)`` with a float p and ``native_dropout`` draw their masks the same way:
# uniform 32-bit integers below floor(p * 2**32) (a probability exact to 2**-32, with
# no float64 arithmetic, which TPUs emulate). ATen's in-place dropout
# (``F.dropout(x, inplace=True)``, aten::dropout_) is ``empty_like(x).bernoulli_(1 - p)``
# while the functional one reaches ``native_dropout``; with one draw both keep the same
# elements under one seed, as on CPU, where both are the same ``bernoulli_``.
def _bernoulli_mask(key, shape, p: float) -> jax.Array:
    """Bool mask of ``shape``, each element True with probability ``p`` (a Python float
    in [0, 1])."""
    if p >= 1:
        return jnp.ones(shape, dtype=jnp.bool_)
    threshold = np.uint32(math.floor(p * 2**32))
    return jax.random.bits(key, shape, dtype=jnp.uint32) < threshold


@lowering(aten.bernoulli_.Tensor, aten.bernoulli.Tensor, self_values=False, cpu_generator=True)
def bernoulli_tensor(self, p, *, generator=None):
    """aten::bernoulli_.Tensor - 1 with probability ``p`` (broadcast to ``self``)."""
    return _bernoulli("bernoulli_.Tensor", self, p)


@lowering(aten.bernoulli.default, cpu_generator=True)
def bernoulli(self, *, generator=None):
    """aten::bernoulli - 1 with probability ``self[i]``; ``self``'s dtype and shape.
    Dtypes: floating ``self`` (the probabilities). Reference: torch.bernoulli."""
    _check_float("bernoulli", self)
    return _bernoulli("bernoulli", self, self)


@jax.jit
def _p_outside(p):
    # (any probability outside [0, 1] or NaN, the first such one), one executable.
    bad = ~((p >= 0) & (p <= 1)).reshape(-1)
    return jnp.any(bad), p.reshape(-1)[jnp.argmax(bad)]


def _bernoulli(op, self, p):
    if not jnp.issubdtype(p.dtype, jnp.floating):
        name = dtypes.aten_type_name(dtypes.to_torch_dtype(p.dtype))
        raise NotImplementedError(f"\"bernoulli_tensor_cpu_p_\" not implemented for '{name}'")
    if p.size:
        # On the device, raised at the next sync (Note [Device-side checks]).
        bad, value = _p_outside(p)
        _checks.require(
            bad,
            value,
            RuntimeError,
            "Expected p_in >= 0 && p_in <= 1 to be true, but got false "
            f"(in aten::{op}: every probability must lie in [0, 1], got {{value}})",
        )
    ct = jnp.float64 if p.dtype == jnp.float64 else jnp.float32
    u = jax.random.uniform(_key(self), self.shape, dtype=ct)
    return (u < jnp.broadcast_to(p.astype(ct), self.shape)).astype(self.dtype)


_FLOAT_DIGITS = {
    jnp.dtype(jnp.float16): 11,
    jnp.dtype(jnp.bfloat16): 8,
    jnp.dtype(jnp.float32): 24,
    jnp.dtype(jnp.float64): 53,
}


def _dtype_max(dtype) -> int:
    """Upper bound (inclusive) of random_() for ``dtype``: 2**digits for floats (every
    integer up to it is exact), the type's max for integers, 1 for bool."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 1
    if dtype in _FLOAT_DIGITS:
        return 2 ** _FLOAT_DIGITS[dtype]
    return int(jnp.iinfo(dtype).max)


def _random_range(op, self, lo: int, hi: int):
    """Integers uniform in [lo, hi) (hi - lo <= 2**64) in ``self``'s dtype, drawn as
    ``lo + bits % (hi - lo)`` in uint64 as torch's CPU kernel does."""
    if not lo < hi:
        raise RuntimeError(
            f"random_ expects 'from' to be less than 'to', but got "
            f"from={lo} >= to={hi} (in aten::{op})"
        )
    bits = jax.random.bits(_key(self), self.shape, dtype=jnp.uint64)
    span = hi - lo
    if span < 2**64:
        bits = bits % np.uint64(span)
    vals = lax.bitcast_convert_type(bits + np.uint64(lo % 2**64), jnp.int64)
    out = vals.astype(self.dtype)
    if jnp.issubdtype(self.dtype, jnp.floating):
        # An integer the float type cannot hold may round up to ``hi``: the result stays
        # in [lo, hi), as on CPU (4999 in float16 is 5000, past ``randint(0, 5000)``).
        up = out.astype(jnp.float64) >= np.float64(hi)
        out = jnp.where(up, jnp.nextafter(out, jnp.asarray(-jnp.inf, self.dtype)), out)
    return out


@lowering(aten.random_.default, aten.random.default, self_values=False, cpu_generator=True)
def random_(self, *, generator=None):
    """aten::random_ - integers uniform on [0, max]: the dtype's max for integers,
    2**mantissa_digits for floats. Reference: torch.Tensor.random_."""
    return _random_range("random_", self, 0, _dtype_max(self.dtype) + 1)


@lowering(
    getattr(aten.random_, "from"),
    getattr(aten.random, "from"),
    self_values=False,
    cpu_generator=True,
)
def random_from(self, from_, to, *, generator=None, **kw):
    """aten::random_.from - integers uniform on [from, to); ``to=None`` means up to the
    dtype's max (inclusive)."""
    from_ = kw.pop("from", from_)
    hi = _dtype_max(self.dtype) + 1 if to is None else to
    return _random_range("random_.from", self, from_, hi)


@lowering(aten.random_.to, aten.random.to, self_values=False, cpu_generator=True)
def random_to(self, to, *, generator=None):
    """aten::random_.to - integers uniform on [0, to)."""
    return _random_range("random_.to", self, 0, to)


@lowering(
    aten.exponential_.default, aten.exponential.default, self_values=False, cpu_generator=True
)
def exponential(self, lambd=1.0, *, generator=None):
    """aten::exponential_ - Exp(lambd) samples, -log1p(-U)/lambd. Dtypes: floating."""
    _check_float("exponential_", self)
    if not lambd > 0:
        raise RuntimeError(
            f"exponential_ expects lambda > 0.0, but found lambda={lambd} (in aten::exponential_)"
        )
    u = _uniform01(_key(self), self.shape, self.dtype)
    return (-jnp.log1p(-u) / lambd).astype(self.dtype)


@lowering(aten.geometric_.default, aten.geometric.default, self_values=False, cpu_generator=True)
def geometric(self, p, *, generator=None):
    """aten::geometric_ - number of Bernoulli(p) trials to the first success (>= 1):
    ceil(log(U) / log1p(-p)), in ``self``'s dtype. Reference: torch.Tensor.geometric_."""
    if not 0 < p < 1:
        raise RuntimeError(
            f"geometric_ expects p to be in (0, 1), but got p={p} (in aten::geometric_)"
        )
    u = jax.random.uniform(
        _key(self), self.shape, dtype=jnp.float64, minval=np.finfo(np.float64).tiny, maxval=1.0
    )
    return jnp.maximum(jnp.ceil(jnp.log(u) / math.log1p(-p)), 1.0).astype(self.dtype)


@lowering(aten.cauchy_.default, aten.cauchy.default, self_values=False, cpu_generator=True)
def cauchy(self, median=0.0, sigma=1.0, *, generator=None):
    """aten::cauchy_ - median + sigma * tan(pi * (U - 1/2)). Dtypes: floating."""
    _check_float("cauchy_", self)
    if not sigma > 0:
        raise RuntimeError(
            f"cauchy_ expects sigma > 0.0, but found sigma={sigma} (in aten::cauchy_)"
        )
    u = _uniform01(_key(self), self.shape, self.dtype)
    return (median + sigma * jnp.tan(np.pi * (u - 0.5))).astype(self.dtype)


@lowering(aten.log_normal_.default, aten.log_normal.default, self_values=False, cpu_generator=True)
def log_normal(self, mean=1.0, std=2.0, *, generator=None):
    """aten::log_normal_ - exp(N(mean, std**2)). Dtypes: floating."""
    _check_float("log_normal_", self)
    if not std > 0:
        raise RuntimeError(
            f"log_normal_ expects std > 0.0, but found std={std} (in aten::log_normal_)"
        )
    z = jax.random.normal(_key(self), self.shape, dtype=_opmath(self.dtype))
    return jnp.exp(z * std + mean).astype(self.dtype)


# ---------------------------------------------------------------------------------------
# random *_like factories (torch's composite kernels do not run for tpu inputs)


def _like(fill):
    def like_handler(args, kwargs):
        from torchjax.ops.factory import like_empty

        t = like_empty(args[0], kwargs)
        return fill(t, *args[1:])

    return like_handler


# The .generator overloads given a generator run on CPU (Note [CPU draws keep the
# layout]); here they have none.
handler(aten.rand_like.default, aten.rand_like.generator, cpu_generator=True)(
    _like(lambda t: t.uniform_())
)
handler(aten.randn_like.default, aten.randn_like.generator, cpu_generator=True)(
    _like(lambda t: t.normal_())
)
handler(
    aten.randint_like.default,
    aten.randint_like.Tensor,
    aten.randint_like.generator,
    aten.randint_like.Tensor_generator,
    cpu_generator=True,
)(_like(lambda t, high: t.random_(0, int(high))))
handler(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, cpu_generator=True)(
    _like(lambda t, low, high: t.random_(low, high))
)


def _sized_out(op, fill):
    """``rand.out``/``randint.out``-style factories (``op``, the out= overload): resize
    ``out`` to ``size`` (torch's out= rule), then fill it in place, in its layout."""

    def sized_out(args, kwargs):
        out, size = kwargs["out"], args[-1]
        arr = jnp.zeros(tuple(size), dtype=dtypes.to_jax_dtype(out.dtype))
        write_into(op, out, wrap(arr, out._device_index), resize=True)
        return fill(out, *args[:-1])

    return sized_out


handler(aten.rand.out, aten.rand.generator_out, cpu_generator=True)(
    _sized_out(aten.rand.out, lambda o: o.uniform_())
)
handler(aten.randint.out, aten.randint.generator_out, cpu_generator=True)(
    _sized_out(aten.randint.out, lambda o, high: o.random_(0, high))
)
handler(aten.randint.low_out, aten.randint.low_generator_out, cpu_generator=True)(
    _sized_out(aten.randint.low_out, lambda o, low, high: o.random_(low, high))
)
# torch's decomposition draws into a new tensor and copies it into ``out``; CPU fills
# ``out`` itself, in its layout (Note [CPU draws keep the layout]).
handler(aten.normal.float_float_out, cpu_generator=True)(
    _sized_out(aten.normal.float_float_out, lambda o, mean, std: o.normal_(mean, std))
)
