"""torch.autocast("tpu")'s policy (torchjax/device/_autocast.py), CUDA's: the op lists
and casts of aten/src/ATen/autocast_mode.cpp."""

import pytest
import torch

import torchjax  # noqa: F401


def _bf16(*shape):
    return torch.rand(*shape, device="tpu").bfloat16()


_FP32_RESULTS = {
    "softmax": lambda x: torch.softmax(x, 0),
    "log_softmax": lambda x: torch.log_softmax(x, 0),
    "functional_softmax": lambda x: torch.nn.functional.softmax(x, 0),
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(0),
    "prod": lambda x: x.prod(),
    "cumsum": lambda x: x.cumsum(0),
    "cumprod": lambda x: x.cumprod(0),
    "norm": lambda x: x.norm(),
    "vector_norm": lambda x: torch.linalg.vector_norm(x),
    "exp": torch.exp,
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (4,)),
}


@pytest.mark.parametrize("name", sorted(_FP32_RESULTS))
def test_precision_sensitive_ops_run_in_float32(name):
    x = _bf16(4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = _FP32_RESULTS[name](x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), _FP32_RESULTS[name](x.float()).cpu())


def test_a_given_dtype_and_float64_are_left_alone():
    x = _bf16(4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert torch.softmax(x, 0, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert x.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.ones(3, dtype=torch.float64, device="tpu").sum().dtype == torch.float64
        assert torch.ones(3, dtype=torch.float64, device="tpu").norm().dtype == torch.float64
        assert torch.ones(3, dtype=torch.int64, device="tpu").sum().dtype == torch.int64


def test_matmuls_run_in_the_autocast_dtype():
    a = torch.rand(4, 4, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        assert torch.nn.functional.linear(a, a).dtype == torch.bfloat16


_PROMOTED = {
    "dot": lambda x, y: torch.dot(x, y),
    "addcmul": lambda x, y: torch.addcmul(x, x, y),
    "addcdiv": lambda x, y: torch.addcdiv(x, x, y + 1),
    "atan2": lambda x, y: torch.atan2(x, y),
    "index_put": lambda x, y: y.index_put((torch.tensor([1], device="tpu"),), x[:1]),
    "scatter_add": lambda x, y: y.scatter_add(0, torch.tensor([0, 1], device="tpu"), x[:2]),
}


@pytest.mark.parametrize("name", sorted(_PROMOTED))
def test_mixed_inputs_are_promoted_to_the_widest(name):
    # bfloat16 with float32 inputs: float32, where the op alone would refuse the mix
    # or keep the first argument's dtype.
    x, y = _bf16(4), torch.rand(4, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = _PROMOTED[name](x, y)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), _PROMOTED[name](x.float(), y).cpu())


def test_binary_cross_entropy_is_refused_as_cuda_does():
    # CUDA's policy bans it inside autocast (it returned bfloat16 silently here).
    x, y = torch.rand(4, device="tpu"), torch.rand(4, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(x, y)
        # The logits form is the safe one, computed in float32.
        out = torch.nn.functional.binary_cross_entropy_with_logits(x, y)
    assert out.dtype == torch.float32
    assert torch.nn.functional.binary_cross_entropy(x, y).dtype == torch.float32


@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_recurrent_cells_run_in_the_autocast_dtype(cell):
    # On CUDA's lower-precision list (they ran in float32 here).
    torch.manual_seed(0)
    layer = cell(3, 4).to("tpu")
    x = torch.rand(2, 3, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.bfloat16
    with torch.autocast("tpu", dtype=torch.bfloat16):
        v = torch.linalg.vecdot(x, x)
    assert v.dtype == torch.bfloat16
