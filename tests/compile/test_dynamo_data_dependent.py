"""Ops that need tensor values inside torch.compile(backend="tpu") graphs run eagerly,
the rest compiled (Note [Data-dependent ops in compiled graphs] in
torchjax/compile/_host_parts.py); under torchjax.jit they raise DataDependentError whose
text names the user's line (Note [Where a data-dependent op was written])."""

import warnings

import pytest
import torch

import torchjax
from torchjax.tensor._errors import DataDependentError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _put(x, m, v):
    x[m] = v  # the line the warning names
    return x


def _increment(x, m):
    x[m] += 1
    return x * 2


def _scalar_then_values(x, m, v):
    x = x * 2
    x[~m] = 0.5
    x[m] = v
    return x + 1, x.sum()


def _accumulate(x, m, v):
    return x.index_put_((m,), v, accumulate=True) * 3


def _args(step):
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0]) * (step + 1)
    return x, x > 0, torch.tensor([10.0, 30.0, 50.0]) * (step + 1)


_CASES = {
    "put": (_put, lambda x, m, v: (x, m, v)),
    "increment": (_increment, lambda x, m, v: (x, m)),
    "scalar_then_values": (_scalar_then_values, lambda x, m, v: (x, m, v)),
    "accumulate": (_accumulate, lambda x, m, v: (x, m, v)),
}


def _tpu(args):
    return [a.to("tpu") for a in args]


@pytest.mark.parametrize("name", sorted(_CASES))
def test_masked_writes_give_cpus_values_and_warn_once(name):
    fn, pick = _CASES[name]
    compiled = torch.compile(fn, backend="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):  # the split, then the split parts again
            cpu = pick(*_args(step))
            tpu = _tpu(cpu)
            # the results, and the inputs as the writes leave them
            want = torch.utils._pytree.tree_leaves((fn(*cpu), cpu))
            got = torch.utils._pytree.tree_leaves((compiled(*tpu), tpu))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.device.type == "tpu" and g.dtype == w.dtype
                torch.testing.assert_close(g.cpu(), w)
    eager = [w for w in caught if "runs it eagerly" in str(w.message)]
    assert len(eager) == 1, [str(w.message) for w in caught]
    text = str(eager[0].message)
    assert "aten::index_put_" in text
    assert "use torch.compile" not in text  # the user already does


def test_the_warning_names_the_line_of_the_masked_write():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0], device="tpu")
    with pytest.warns(UserWarning, match="runs it eagerly") as caught:
        got = torch.compile(_put, backend="tpu")(x, x > 0, torch.tensor([10.0, 30.0], device="tpu"))
    torch.testing.assert_close(got.cpu(), torch.tensor([10.0, -2.0, 30.0, -4.0]))
    text = "\n".join(str(w.message) for w in caught)
    assert f"{__file__}:{_put.__code__.co_firstlineno + 1}: x[m] = v" in text


def test_the_rest_of_the_graph_stays_compiled():
    def fn(x, m, v):
        y = x.sin() * 2
        y[m] = v
        return y.exp().sum()

    compiled = torch.compile(fn, backend="tpu", fullgraph=True)
    before = torchjax.compile.dynamo_stats()
    with pytest.warns(UserWarning, match="runs it eagerly"):
        for step in range(3):
            x = torch.tensor([1.0, -2.0, 3.0]) + step
            v = torch.tensor([0.5, 0.25])
            got = compiled(x.to("tpu"), (x > 0).to("tpu"), v.to("tpu"))
            torch.testing.assert_close(got.cpu(), fn(x, x > 0, v))
    after = torchjax.compile.dynamo_stats()
    assert after["graphs"] - before["graphs"] == 1
    assert after["traces"] - before["traces"] == 2  # before the write and after it
    assert after["cache_hits"] - before["cache_hits"] == 4


def test_a_masked_scalar_write_stays_in_the_program():
    def fn(x, m):
        x[m] = 5.0
        return x * 2

    x = torch.tensor([1.0, -2.0, 3.0, -4.0])
    xt = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback needed
        got = torch.compile(fn, backend="tpu", fullgraph=True)(xt, xt > 0)
    want = fn(x, x > 0)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(xt.cpu(), x)


def test_under_torchjax_jit_a_masked_write_raises_with_advice_for_jit():
    jitted = torchjax.jit(_put)
    x = torch.tensor([1.0, -2.0, 3.0, -4.0], device="tpu")
    with pytest.raises(DataDependentError) as info:
        jitted(x, x > 0, torch.tensor([10.0, 30.0], device="tpu"))
    text = str(info.value)
    assert "aten::index_put_" in text
    assert f"{__file__}:{_put.__code__.co_firstlineno + 1}: x[m] = v" in text
    assert "x.masked_scatter(mask, values)" in text  # a fixed-shape way to write it
    assert 'torch.compile(fn, backend="tpu")' in text  # which runs the op eagerly
    assert ".item()" not in text  # the user's line reads no value into Python
    torch.testing.assert_close(x.cpu(), torch.tensor([1.0, -2.0, 3.0, -4.0]))
