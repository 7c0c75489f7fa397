"""torch's own bad-input table: every OpInfo ``error_inputs`` sample, on CPU and on tpu.

Each ErrorInput is a call torch's test suite says must raise (``error_type``, with a
regex). Here the same call runs on CPU and, with its tensors moved, on tpu: where CPU
raises, tpu must raise the same exception type (Note [One error layer] in
torchjax/tensor/_errors.py). Samples CPU accepts are device-specific (written for CUDA)
and compared nowhere. Device-side checks raise at the next sync, so tensor outputs are
read back.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_leaves, tree_map

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import XFAILS
from torchjax.testing.opinfo import error_samples


def _mover():
    """CPU tensor -> the same view of one tpu copy of its storage: tensors that share
    memory on CPU (an out= that is a view of the input, an expanded out) share it on tpu,
    so the aliasing checks see the same call."""
    bases = {}

    def move(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.dtype)
        if key not in bases:
            whole = torch.empty(0, dtype=t.dtype)
            whole.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
            bases[key] = whole.to("tpu")
        moved = bases[key].as_strided(t.shape, t.stride(), t.storage_offset())
        return moved.detach().requires_grad_() if t.requires_grad else moved

    return move


def _raise_of(op, sample, to_tpu=False):
    try:
        args = (sample.input, *sample.args)
        kwargs = sample.kwargs
        if to_tpu:  # inside the try: a tensor tpu cannot hold is tpu's refusal
            args, kwargs = tree_map(_mover(), (args, kwargs))
        out = op(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "tpu":
                t.cpu()
    except Exception as error:  # noqa: BLE001 - compared against CPU's below
        return error
    return None


def _name(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _cases():
    # Ops with at least one error input that CPU refuses (the others are written for
    # CUDA only); the same CPU-made inputs then go to tpu, so both sides see one call.
    cases = []
    for op in op_db:
        if op.error_inputs_func is None:
            continue
        if not any(_raise_of(op, ei.sample_input) for ei in error_samples(op)):
            continue
        key = (_name(op), "any", "error_inputs")
        marks = [pytest.mark.xfail(reason=XFAILS[key], strict=True)] if key in XFAILS else []
        cases.append(pytest.param(op, id=key[0], marks=marks))
    return cases


@pytest.mark.parametrize("op", _cases())
def test_error_inputs_raise_cpus_exception_type(op):
    compared, wrong = 0, []
    for ei in error_samples(op):
        cpu_error = _raise_of(op, ei.sample_input)
        if cpu_error is None:
            continue  # written for another device
        compared += 1
        tpu_error = _raise_of(op, ei.sample_input, to_tpu=True)
        if not isinstance(tpu_error, type(cpu_error)):
            got = (
                "no exception" if tpu_error is None else f"{type(tpu_error).__name__}: {tpu_error}"
            )
            wrong.append(f"CPU {type(cpu_error).__name__}: {cpu_error} | tpu {got}")
    assert compared, f"{_name(op)}: CPU raised for none of its error inputs: nothing compared"
    assert not wrong, "\n".join(wrong)
