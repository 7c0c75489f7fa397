"""out= calls refused for their dtype raise CPU's exception and text (Note [out=
refusals in CPU's words] in torchjax/ops/out_refusals.py)."""

import warnings

import pytest
import torch

import torchjax  # noqa: F401

X = torch.arange(12.0).reshape(3, 4) / 7 - 0.5
Z = torch.complex(X, X.flip(0))
IDX = torch.tensor([0, 2])


def _empty(device, dtype=torch.int64):
    return torch.empty(0, dtype=dtype, device=device)


# One call per kernel family: TensorIterator (binary, unary, float-promoting, ternary,
# reductions), same-dtype TensorIterator ops, structured kernels outside it, kernels
# with their own words, composites reaching them (stack, outer, norm).
CALLS = {
    "add": lambda d: torch.add(X.to(d), 1, out=_empty(d)),
    "add_complex_into_float": lambda d: torch.add(Z.to(d), 1, out=_empty(d, torch.float32)),
    "add_long_into_bool": lambda d: torch.add(IDX.to(d), 1, out=_empty(d, torch.bool)),
    "mul": lambda d: torch.mul(X.to(d), X.to(d), out=_empty(d)),
    "div_of_ints": lambda d: torch.div(IDX.to(d), 2, out=_empty(d)),
    "sin_of_ints": lambda d: torch.sin(IDX.to(d), out=_empty(d)),
    "addcmul": lambda d: torch.addcmul(X.to(d), X.to(d), X.to(d), out=_empty(d)),
    "mean": lambda d: torch.mean(X.to(d), 0, out=_empty(d)),
    "std": lambda d: torch.std(X.to(d), 0, out=_empty(d)),
    "neg": lambda d: torch.neg(X.to(d), out=_empty(d)),
    "round": lambda d: torch.round(X.to(d), out=_empty(d)),
    "clamp": lambda d: torch.clamp(X.to(d), X.to(d), X.to(d), out=_empty(d)),
    "where": lambda d: torch.where(X.to(d) > 0, X.to(d), X.to(d), out=_empty(d)),
    "matmul": lambda d: torch.matmul(X.to(d), X.T.to(d), out=_empty(d)),
    "mm": lambda d: torch.mm(X.to(d), X.T.to(d), out=_empty(d)),
    "cat": lambda d: torch.cat([X.to(d), X.to(d)], out=_empty(d)),
    "stack": lambda d: torch.stack([X.to(d), X.to(d)], out=_empty(d)),
    "index_select": lambda d: torch.index_select(X.to(d), 0, IDX.to(d), out=_empty(d)),
    "sort": lambda d: torch.sort(X.to(d), out=(_empty(d), _empty(d))),
    "max_dim": lambda d: torch.max(X.to(d), 0, out=(_empty(d), _empty(d))),
    "max_all": lambda d: torch.max(X.to(d), out=_empty(d)),
    "cummax": lambda d: torch.cummax(X.to(d), 0, out=(_empty(d), _empty(d))),
    "kthvalue": lambda d: torch.kthvalue(X.to(d), 2, out=(_empty(d), _empty(d))),
    "median_dim": lambda d: torch.median(X.to(d), 0, out=(_empty(d), _empty(d))),
    "amax": lambda d: torch.amax(X.to(d), 0, out=_empty(d)),
    "logsumexp": lambda d: torch.logsumexp(X.to(d), 0, out=_empty(d)),
    "norm": lambda d: torch.norm(X.to(d), dim=0, out=_empty(d)),
    "tril": lambda d: torch.tril(X.to(d), out=_empty(d)),
    "outer": lambda d: torch.outer(X[0].to(d), X[0].to(d), out=_empty(d)),
    "take": lambda d: torch.take(X.to(d), IDX.to(d), out=_empty(d)),
    "masked_select": lambda d: torch.masked_select(X.to(d), X.to(d) > 0, out=_empty(d)),
    "nan_to_num": lambda d: torch.nan_to_num(X.to(d), out=_empty(d)),
    "histc": lambda d: torch.histc(X.to(d), out=_empty(d)),
    "adaptive_avg_pool2d": lambda d: torch._C._nn.adaptive_avg_pool2d(
        X[None].to(d), [2, 2], out=_empty(d)
    ),
    "gelu": lambda d: torch._C._nn.gelu(X.to(d), out=_empty(d)),
    # Their meta functions accept an out CPU's kernel refuses.
    "angle": lambda d: torch.angle(X.to(d), out=_empty(d)),
    "angle_of_complex": lambda d: torch.angle(Z.to(d), out=_empty(d)),
}


def _answer(call, device):
    try:
        call(device)
    except Exception as error:  # noqa: BLE001 - compared with CPU's below
        return type(error), str(error).split(" (in aten::")[0]
    return None


@pytest.mark.parametrize("name", sorted(CALLS))
def test_out_dtype_refusal_is_cpus(name):
    cpu = _answer(CALLS[name], "cpu")
    assert cpu is not None, f"CPU accepts {name}: the case tests nothing"
    assert _answer(CALLS[name], "tpu") == cpu


def test_the_sample_spans_cpus_wordings():
    texts = {_answer(call, "cpu")[1].split(" ")[0] for call in CALLS.values()}
    # "result type...", "Found dtype...", "Expected out tensor...", and kernels' own.
    assert {"result", "Found", "Expected", "index_select():", "torch.cat():"} <= texts


def test_the_refusal_keeps_the_overload_named():
    with pytest.raises(RuntimeError, match=r"output type Long \(in aten::add\.out\)$"):
        CALLS["add"]("tpu")


def test_mean_of_complex_into_a_real_out_writes_the_real_part_as_cpu():
    # CPU's mean kernel takes what its meta function refuses.
    results = {}
    for device in ("cpu", "tpu"):
        out = _empty(device, torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # discarding the imaginary part
            got = torch.mean(Z.to(device), 0, out=out)
        assert got is out
        results[device] = out.cpu()
    assert results["tpu"].dtype == torch.float32
    torch.testing.assert_close(results["tpu"], results["cpu"])


def test_accepted_casts_still_write():
    # cumsum of float into int64 (the out's dtype is the op's dtype) and sum of complex
    # into float: CPU accepts both; so do we, with CPU's values.
    for call in (
        lambda d: torch.cumsum(X.to(d) * 7, 0, out=_empty(d)),
        lambda d: torch.sum(Z.to(d), 0, out=_empty(d, torch.float32)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert torch.equal(call("tpu").cpu(), call("cpu"))
