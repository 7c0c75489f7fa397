"""Optimizer hyperparameters under torchjax.jit: traced inputs or guards, never constants.

Note [Hyperparameters: traced or guarded]
A torch optimizer reads its hyperparameters from ``param_groups`` as Python numbers at
every ``step()``, and every LR scheduler (StepLR, LambdaLR, OneCycleLR...) changes them by
assigning ``group["lr"] = ...``. A trace reads them once: a number read at trace time
and then baked into the program would keep training with the traced learning rate,
silently. So each one is either an input of the program or part of the cache key:

- ``lr`` is an input (a 0-d tpu tensor in the group while the trace runs, float32, or
  float64 when the group has float64 parameters or the default dtype is float64): a
  schedule changes it every step without a retrace. Only for optimizers whose step takes
  a tensor lr without reading it back to the host: Adam and AdamW in capturable mode
  (torchjax.jit switches optimizers to it, see ``compile._capturable``), and SGD, whose
  single-tensor and foreach paths call ``.item()`` on a tensor lr, so while the trace runs
  its groups take the fused path (``_fused_sgd_`` has a tensor-lr overload; the same
  update as the other paths, see ops/fused_optim.py's ``_sgd_step``);
- every other group entry (momentum, betas, eps, weight_decay, flags, and lr of any
  other optimizer) and every non-tensor or CPU-tensor value in ``optimizer.state`` (a
  step count kept on the host) is a guard: its value is part of the cache key, so a
  change retraces (counted, and named by ``last_retrace_reason``).
Tensors on tpu in a group or the state are state inputs (Note [State of a jitted
function]); nothing read from an optimizer is a constant of the program.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from torchjax.tensor._tensor import JaxTensor, wrap

# Optimizers whose step runs with a tensor lr on device (in capturable mode, which
# torchjax.jit sets; for SGD through its fused path). AdamW subclasses Adam.
_TENSOR_LR = (torch.optim.Adam, torch.optim.SGD)
_FUSABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Hypers:
    """The hyperparameters of one call: traced learning rates and guarded values.

    ``slots``: (param group, uses_fused_sgd, device index) of each traced lr;
    ``values``: their current values (0-d NumPy arrays, inputs of the program);
    ``key``: the guarded values, part of the cache key.
    """

    __slots__ = ("slots", "values", "key")

    def __init__(self, optimizers):
        self.slots, self.values = [], []
        key = []
        for opt in optimizers:
            for group in opt.param_groups:
                traced = self._trace_lr(opt, group)
                key.append(_group_key(group, "lr" if traced else None))
            key.append(_state_key(opt))
        self.key = tuple(key)

    def _trace_lr(self, opt, group) -> bool:
        lr = group.get("lr")
        if isinstance(lr, JaxTensor) or not isinstance(opt, _TENSOR_LR):
            return False
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                return False
            lr = lr.item()
        if type(lr) not in (float, int):
            return False
        params = [p for p in group["params"] if isinstance(p, JaxTensor)]
        if not params or len(params) != len(group["params"]):
            return False
        sgd = isinstance(opt, torch.optim.SGD)
        if sgd and not all(p.dtype in _FUSABLE for p in params):
            return False
        wide = torch.get_default_dtype() == torch.float64 or any(
            p.dtype == torch.float64 for p in params
        )
        self.slots.append((group, sgd, params[0]._device_index))
        self.values.append(np.asarray(lr, np.float64 if wide else np.float32))
        return True


def _freeze(v):
    """A hashable stand-in for one guarded value."""
    if isinstance(v, JaxTensor):
        return "<tpu tensor>"  # a state input, not a guard
    if isinstance(v, torch.Tensor):
        if v.numel() <= 16:
            return ("tensor", v.dtype, tuple(v.detach().reshape(-1).tolist()))
        return ("tensor", id(v), v._version)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_freeze(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v), v)


def _group_key(group, skip):
    return tuple((k, _freeze(v)) for k, v in group.items() if k != "params" and k != skip)


def _state_key(opt):
    out = []
    for st in opt.state.values():
        for k, v in st.items():
            if not isinstance(v, JaxTensor):
                out.append((k, _freeze(v)))
    return tuple(out)


@contextlib.contextmanager
def bound(slots, arrays, assigned: list):
    """Within the block, each traced group's ``lr`` is a tpu tensor holding ``arrays[i]``
    (a tracer) and SGD groups take the fused path; the groups are restored afterwards.
    A group whose ``lr`` the block assigned or wrote in place is appended to
    ``assigned`` (Note [Learning rates assigned while tracing])."""
    saved = []
    try:
        for (group, sgd, index), a in zip(slots, arrays):
            keys = ("lr", "fused", "foreach") if sgd else ("lr",)
            placed = wrap(a, index)
            saved.append((group, placed, a, {k: group[k] for k in keys if k in group}))
            group["lr"] = placed
            if sgd:
                group["fused"], group["foreach"] = True, False
        yield
    finally:
        for group, placed, a, old in saved:
            if group["lr"] is not placed or placed._storage.arr is not a:
                assigned.append(group)
            group.update(old)


# Note [Learning rates assigned while tracing]
# An LR scheduler stepped inside the jitted function sets ``group["lr"]`` while the
# trace runs (torch's schedulers ``fill_`` a tensor lr in place, or assign a number),
# where the traced lr is a tensor that ``bound`` puts back afterwards: the new rate was
# lost, and every step trained at the first step's rate, silently. The new rate is a
# value of the trace (a closed-form schedule's number filled into a traced tensor), and
# the scheduler's own Python state advances only when the function is traced, so a
# compiled step cannot repeat it. torchjax.jit refuses such a function with a clear
# error: step the scheduler after the jitted call, where the lr, an input of the
# program, changes with no retrace. (Schedules of optimizers whose lr is a guard, not
# an input, retrace on each new lr and were right already.)
