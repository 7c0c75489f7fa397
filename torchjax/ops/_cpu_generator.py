"""Random ops given a CPU ``generator=`` on tpu tensors: the overload itself runs on CPU
(Note [CPU generators on tpu] in torchjax/ops/random.py says why a CPU generator).

Note [CPU draws keep the layout]
CPU's samplers (uniform_, normal_, bernoulli_, exponential_, random_, cauchy_,
log_normal_, geometric_) fill their output one element at a time through a
TensorIterator, which orders the dimensions by stride: the elements are drawn in
increasing address order, so a transpose is filled down its columns, a channels-last
permutation channel first, and only a row-major layout (a row-major strided slice
included) is filled in index order. normal_ also changes algorithm with the layout:
a contiguous tensor of 16 elements or more gets Box-Muller over blocks of 16 float
uniforms (``normal_fill``), any other one a double Box-Muller per element, the second
value cached, which also advances the generator differently. Functional overloads carry
their inputs' layout into the draw: ``aten.uniform`` and ``bernoulli.p`` fill a clone
of ``self`` (layout kept), ``*_like`` fill ``empty_like(self)``, multinomial without
replacement draws into ``empty_like(self)``; ``out=`` overloads fill ``out`` in place when
its shape is right. Drawing into a row-major copy, as we once did, gives other values
for every such view. So the overload runs on CPU with each tpu tensor argument replaced by
a CPU tensor of the same sizes, strides and dtype (the values of those it reads), and
the results come back by value: what it wrote into an in-place or ``out=`` argument is
written into that tpu tensor (row-major tpu results stay row-major), a returned tensor
moves to the tpu device. Values and the generator's advance are then CPU's for any
layout, whatever path this CPU's torch build takes (MKL's Bernoulli on Intel CPUs draws
in index order, the default kernel in address order), and CPU's errors (a written
tensor with overlapping elements, bad arguments) are raised as CPU raises them.
"""

from __future__ import annotations

import jax
import torch

from torchjax.tensor import random as _rng
from torchjax.tensor._tensor import JaxTensor

_CPU = torch.device("cpu")


def routed(func, handler):
    """``handler`` for calls without a generator; calls with one run ``func`` on CPU
    (Note [CPU draws keep the layout])."""
    written = frozenset(
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )
    names = [a.name for a in func._schema.arguments]
    # Keyword-only in the samplers' schemas, positional in torch.distributions' ops
    # (``poisson(self, generator)``).
    at = names.index("generator") if "generator" in names else len(names)

    def route(args, kwargs):
        generator = kwargs.get("generator", args[at] if at < len(args) else None)
        if generator is None:
            return handler(args, kwargs)
        return run_on_cpu(func, names, written, generator, args, kwargs)

    return route


def run_on_cpu(func, names, written, generator, args, kwargs):
    """``func(*args, **kwargs)`` run on CPU twins of its tpu tensors (``names``: the
    schema's argument names, ``written``: those it writes), its writes and result brought
    back to tpu."""
    op = f"aten::{func._opname}"
    if generator.device.type != "cpu":
        raise RuntimeError(
            f"{op}: expected a CPU generator for a tpu tensor, got one on {generator.device}"
        )
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, JaxTensor)]
    # A trace's stream is set even when every input is concrete (a tensor made inside
    # the traced function holds a concrete array of zeros until it is written).
    if _rng.traced_stream() is not None or any(map(_traced, tensors)):
        raise RuntimeError(
            f"{op}: generator= cannot drive a draw inside torchjax.jit (a CPU draw "
            "would be a constant of the trace); drop generator= there and seed with "
            "torch.manual_seed, or draw outside the jitted function and pass the tensor in"
        )
    cpu_args = [_twin(a, names[i] not in written) for i, a in enumerate(args)]
    cpu_kwargs = {k: _twin(v, k not in written) for k, v in kwargs.items()}
    device = kwargs.get("device")
    if device is not None:  # a *_like op's target device: the draw itself is on CPU
        cpu_kwargs["device"] = _CPU
    result = func(*cpu_args, **cpu_kwargs)
    for i, a in enumerate(args):
        if names[i] in written:
            _write_back(a, cpu_args[i])
    for k, v in kwargs.items():
        if k in written:
            _write_back(v, cpu_kwargs[k])
    ret = func._schema.returns
    if ret and ret[0].alias_info is not None:  # in-place or out=: the tpu tensor written
        alias = ret[0].alias_info
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == alias.before_set:
                return args[i] if i < len(args) else kwargs[a.name]
    if device is None:
        device = next((t.device for t in tensors), None)
    return result if device is None else result.to(device)


def _traced(t: JaxTensor) -> bool:
    storage = t._storage
    return storage.lazy is None and isinstance(storage.arr, jax.core.Tracer)


def _twin(x, read: bool):
    """A CPU tensor with ``x``'s sizes, strides and dtype (and values, when ``read``);
    anything but a tpu tensor as it is."""
    if not isinstance(x, JaxTensor):
        return x
    size, stride = tuple(x.shape), x.stride()
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if x.numel() else 0
    storage = torch.empty(span, dtype=x.dtype)
    if read and span:
        # Scattered by address: an expanded input (stride 0) holds each value once.
        where = torch.arange(span).as_strided(size, stride).reshape(-1)
        storage[where] = x.cpu().reshape(-1)
    return storage.as_strided(size, stride)


def _write_back(dst: JaxTensor, src: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        # CPU resized its out= twin (and warned, as the op on CPU does): so does ``dst``.
        dst.resize_(src.shape)
    dst.copy_(src)
