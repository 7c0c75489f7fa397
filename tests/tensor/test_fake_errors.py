"""Errors of ops traced by torch.compile: eager's type and text, no meta-kernel log
(Note [Errors of ops traced with fake tensors] in torchjax/tensor/_fake_errors.py)."""

import logging

import pytest
import torch

import torchjax  # noqa: F401
from torchjax._compat.torch_dynamo import fake_tensor_logger

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def fake_tensor_records():
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = fake_tensor_logger()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _chain(error):
    seen = []
    while error is not None and len(seen) < 16:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _eager_and_compiled(fn, *args):
    with pytest.raises(Exception) as eager:
        fn(*args)
    with pytest.raises(Exception) as compiled:
        torch.compile(fn, backend="tpu")(*args)
    return eager.value, compiled.value


_CALLS = {
    "mm": (lambda a, b: torch.mm(a, b) + 1, ((2, 3), (4, 5))),
    "linear": (lambda x, w: torch.nn.functional.linear(x, w), ((2, 5), (3, 4))),
    "view": (lambda x: x.view(3, 7), ((4, 5),)),
    "cat": (lambda a, b: torch.cat([a, b], dim=1), ((2, 3), (4, 3))),
}


@pytest.mark.parametrize("fn,shapes", _CALLS.values(), ids=_CALLS.keys())
def test_a_traced_op_raises_eagers_error_without_the_meta_log(fn, shapes, fake_tensor_records):
    args = [torch.ones(s, device="tpu") for s in shapes]
    eager, compiled = _eager_and_compiled(fn, *args)
    assert str(eager) in str(compiled), (eager, compiled)
    # No record of the meta kernel's failure, and nothing from the registry's attempt on
    # a tensor without storage in the chain.
    assert not [r for r in fake_tensor_records if r.levelno >= logging.ERROR]
    assert not any(isinstance(e, AttributeError) for e in _chain(compiled))


def test_symbolic_sizes_keep_the_meta_kernels_error_and_log(fake_tensor_records):
    x = torch.ones(4, 5, device="tpu")
    torch._dynamo.mark_dynamic(x, 0)
    w = torch.ones(3, 2, device="tpu")
    with pytest.raises(Exception, match="must have same reduction dim"):
        torch.compile(lambda x, w: x @ w, backend="tpu")(x, w)
    assert [r for r in fake_tensor_records if r.levelno >= logging.ERROR]


def test_cpu_tensors_keep_torchs_log(fake_tensor_records):
    with pytest.raises(Exception, match="must have same reduction dim"):
        torch.compile(lambda a, b: a @ b, backend="eager")(torch.ones(2, 3), torch.ones(4, 5))
    assert [r for r in fake_tensor_records if r.levelno >= logging.ERROR]
