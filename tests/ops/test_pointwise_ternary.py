"""OpInfo sweep and direct tests for torchjax/ops/pointwise_ternary.py: lerp, addcmul,
addcdiv."""

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests
from tests.ops.test_pointwise_binary import tpu

OPS = ["lerp", "addcmul", "addcdiv"]
globals().update(make_tests(OPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", [torch.addcmul, torch.addcdiv])
def test_addcmul_addcdiv_bit_for_bit(op, dtype):
    # CPU's order, (value * t1) * t2 and (value * t1) / t2, and addcmul's FMA: an
    # optimizer's moments (exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)) then match
    # CPU's bit for bit. (float64 has no wider type to form the FMA in when the op runs
    # primitive by primitive: it can differ from CPU in the last bit.)
    g = torch.Generator().manual_seed(0)
    s, a, b = ((torch.randn(4096, generator=g)).to(dtype) for _ in range(3))
    b = b.abs() + 0.5
    checked = 0
    for value in [0.001, 1, -2.5]:
        want = op(s, a, b, value=value)
        got = op(s.to("tpu"), a.to("tpu"), b.to("tpu"), value=value).cpu()
        assert torch.equal(got, want), value
        checked += 1
    assert checked == 3


_INTEGER_ADDCDIV = {
    "int tensors, float self": (torch.tensor([1.0]), torch.tensor([1]), torch.tensor([2]), {}),
    "int tensors, int self": (torch.tensor([1]), torch.tensor([3]), torch.tensor([2]), {}),
    "bool and int8": (
        torch.tensor([1.0]),
        torch.tensor([True]),
        torch.tensor([2], dtype=torch.int8),
        dict(value=2),
    ),
    "in place": (torch.tensor([1.0]), torch.tensor([1]), torch.tensor([2]), dict(inplace=True)),
    "out=": (torch.tensor([1.0]), torch.tensor([1]), torch.tensor([2]), dict(out=True)),
}


@pytest.mark.parametrize("name", sorted(_INTEGER_ADDCDIV))
def test_addcdiv_refuses_integer_tensors_as_cpu(name):
    # Checked on the tensors' own dtypes, before promotion makes them float: CPU's
    # RuntimeError and text, eager and under torchjax.jit. Under torch.compile what CPU's
    # torch.compile does: torch's meta check refuses it while Dynamo traces, except
    # where Dynamo rewrites the call as div, mul and add first (a bool tensor1).
    s, t1, t2, kw = _INTEGER_ADDCDIV[name]
    kw = dict(kw)
    inplace, to_out = kw.pop("inplace", False), kw.pop("out", False)

    def fn(s, t1, t2):
        if inplace:
            return s.addcdiv_(t1, t2, **kw)
        if to_out:
            return torch.addcdiv(s, t1, t2, out=torch.empty_like(s), **kw)
        return torch.addcdiv(s, t1, t2, **kw)

    with pytest.raises(RuntimeError) as cpu:
        fn(s.clone(), t1, t2)
    text = str(cpu.value)
    assert text.startswith("Integer division with addcdiv is no longer supported")
    checked = 0
    for run in (fn, torchjax.jit(fn)):
        with pytest.raises(RuntimeError) as got:
            run(s.to("tpu"), t1.to("tpu"), t2.to("tpu"))
        assert str(got.value).startswith(text), str(got.value)
        checked += 1
    compiled = {}
    for backend, device in (("eager", "cpu"), ("tpu", "tpu")):
        torch._dynamo.reset()
        try:
            got = torch.compile(fn, backend=backend)(s.to(device), t1.to(device), t2.to(device))
            compiled[backend] = got.cpu().tolist()
        except RuntimeError as error:
            compiled[backend] = "Integer division with addcdiv" in str(error)
    assert compiled["tpu"] == compiled["eager"], compiled
    assert checked == 2


def test_addcdiv_with_one_float_tensor_divides_as_cpu():
    s, t1, t2 = torch.tensor([1.0, 2.0]), torch.tensor([3, 4]), torch.tensor([2.0, 8.0])
    for a, b in ((t1, t2), (t2, t1)):
        want = torch.addcdiv(s, a, b, value=0.5)
        got = torch.addcdiv(s.to("tpu"), a.to("tpu"), b.to("tpu"), value=0.5)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lerp_bit_for_bit(dtype):
    # CPU's vectorised lerp is one FMA from the nearer end (an optimizer's
    # exp_avg.lerp_(grad, 1 - beta1)); 4096 elements keep it in the vectorised loop.
    g = torch.Generator().manual_seed(0)
    start, end = (torch.randn(4096, generator=g).to(dtype) for _ in range(2))
    tensor_weight = torch.rand(4096, generator=g).to(dtype) * 1.4 - 0.2
    checked = 0
    for weight in [0.1, 0.3, 0.7, 0.95, tensor_weight]:
        want = torch.lerp(start, end, weight)
        tpu_weight = weight.to("tpu") if isinstance(weight, torch.Tensor) else weight
        got = torch.lerp(start.to("tpu"), end.to("tpu"), tpu_weight).cpu()
        assert torch.equal(got, want), weight
        checked += 1
    assert checked == 5


def test_lerp_refuses_mixed_dtypes_as_cpu():
    # torch does not promote lerp's inputs: end, and a weight of more than one element,
    # must have self's dtype (a 0-d weight tensor is read as a number).
    def lerps(dev):
        z, one = torch.zeros(2, device=dev), torch.ones(2, device=dev)
        return [
            lambda: torch.lerp(z, one.double(), 0.5),
            lambda: torch.lerp(z, torch.ones((), dtype=torch.float64, device=dev), 0.5),
            lambda: torch.lerp(z, one, torch.full((2,), 0.5, dtype=torch.float64, device=dev)),
        ]

    checked = 0
    for cpu_call, tpu_call in zip(lerps("cpu"), lerps("tpu")):
        with pytest.raises(RuntimeError) as cpu_error:
            cpu_call()
        with pytest.raises(RuntimeError) as tpu_error:
            tpu_call()
        assert str(cpu_error.value) in str(tpu_error.value)
        checked += 1
    assert checked == 3
    weight = torch.tensor(0.25, dtype=torch.float64)
    want = torch.lerp(torch.zeros(2), torch.ones(2), weight)
    got = torch.lerp(torch.zeros(2, device="tpu"), torch.ones(2, device="tpu"), weight.to("tpu"))
    assert torch.equal(got.cpu(), want)


_ADDCMUL_VALUES = [0.5, 1.7, -1.5, 2, True]


@pytest.mark.parametrize(
    "op, dtype",
    [
        (torch.addcmul, torch.float32),
        (torch.addcmul, torch.float64),
        (torch.addcmul, torch.int64),
        (torch.addcdiv, torch.float32),  # addcdiv refuses integer tensors first
        (torch.addcdiv, torch.float64),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_complex_value_of_a_real_addcmul_addcdiv_overflows_as_cpu(op, dtype):
    # CPU reads value as the result type (c10's checked conversion); no alpha check.
    t = torch.tensor([1.0, 2.0]).to(dtype)
    with pytest.raises(RuntimeError) as cpu:
        op(t, t, t, value=1j)
    with pytest.raises(RuntimeError) as got:
        op(tpu(t), tpu(t), tpu(t), value=1j)
    assert str(got.value).split(" (in aten::")[0] == str(cpu.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("value", _ADDCMUL_VALUES, ids=repr)
def test_addcmul_integer_and_bool_as_cpu(dtype, value):
    # An integer kernel reads a float value as its own type (truncated); bool has none.
    x = torch.tensor([3, 4, 0]).to(dtype)
    outcomes = {}
    for device in ("cpu", "tpu"):
        t = x.to(device)
        try:
            outcomes[device] = torch.addcmul(t, t, t, value=value).tolist()
        except (RuntimeError, NotImplementedError) as e:
            outcomes[device] = (type(e), str(e).split(" (in aten::")[0])
    assert outcomes["tpu"] == outcomes["cpu"]
