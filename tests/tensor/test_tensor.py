"""JaxTensor behaves like a torch tensor on a device: metadata, conversions, printing."""

import pytest
import torch

import torchjax
from torchjax.tensor import JaxTensor


def test_metadata():
    x = torch.randn(2, 3, dtype=torch.float64).to("tpu")
    assert isinstance(x, torch.Tensor) and isinstance(x, JaxTensor)
    assert x.shape == (2, 3) and x.dtype == torch.float64
    assert str(x.device) == "tpu:0"
    assert x.stride() == (3, 1) and x.is_contiguous()
    assert not x.requires_grad
    x.requires_grad_()
    assert x.requires_grad and x.is_leaf


def test_conversions():
    x = torch.tensor([[1.5, 2.0], [3.0, -4.0]]).to("tpu")
    assert x.cpu().device.type == "cpu"
    assert x.numpy().tolist() == [[1.5, 2.0], [3.0, -4.0]]
    assert x.tolist() == [[1.5, 2.0], [3.0, -4.0]]
    assert x[1, 1].item() == -4.0
    assert float(x[0, 0]) == 1.5 and int(x[0, 1]) == 2
    with pytest.raises(RuntimeError, match="requires grad"):
        x.clone().requires_grad_().numpy()


def test_cpu_copy_is_independent():
    x = torch.ones(3).to("tpu")
    c = x.cpu()
    c.add_(1)
    assert x.tolist() == [1.0, 1.0, 1.0]
    src = torch.zeros(3)
    y = src.to("tpu")
    src.fill_(5)
    assert y.tolist() == [0.0, 0.0, 0.0]


def test_repr_like_torch():
    x = torch.tensor([1.0, 2.0]).to("tpu")
    assert repr(x) == "tensor([1., 2.], device='tpu:0')"
    h = torch.tensor([1, 2], dtype=torch.int32).to("tpu")
    assert repr(h) == "tensor([1, 2], device='tpu:0', dtype=torch.int32)"
    g = torch.ones(2, device="tpu", requires_grad=True)
    assert "requires_grad=True" in repr(g)
    assert "grad_fn=<MulBackward0>" in repr(g * 2)
    assert str(x) == repr(x)
    p = torch.nn.Parameter(torch.zeros(1)).to("tpu")
    assert repr(torch.nn.Linear(1, 1).to("tpu").weight).startswith("Parameter containing:")
    del p


def test_cpu_scalar_tensor_allowed_other_cpu_tensors_rejected():
    x = torch.ones(3).to("tpu")
    assert (x * torch.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="tpu:0 and cpu"):
        x + torch.ones(3)


def test_to_jax_from_jax_share_memory():
    import jax.numpy as jnp

    a = jnp.arange(4.0)
    t = torchjax.from_jax(a)
    assert t.device.type == "tpu" and t.dtype == torch.float32
    assert torchjax.to_jax(t) is a


def test_unsupported_op_names_the_overload():
    # Quantized tensors have no jax representation: a clear error, not a wrong answer.
    x = torch.ones(2, 2).to("tpu")
    msg = (
        r"aten::quantize_per_tensor.default, called with \(Tensor\[float32, \(2, 2\)\] "
        r"on tpu:0, 0.1, 0, torch.quint8\)"
    )
    with pytest.raises(NotImplementedError, match=msg):
        torch.ops.aten.quantize_per_tensor(x, 0.1, 0, torch.quint8)


def test_detach_shares_storage():
    x = torch.zeros(3, device="tpu", requires_grad=True)
    d = x.detach()
    d.add_(2)
    assert x.tolist() == [2.0, 2.0, 2.0]


def test_data_assignment():
    p = torch.nn.Parameter(torch.zeros(2).to("tpu"))
    p.data = torch.ones(3).to("tpu")
    assert p.shape == (3,) and p.tolist() == [1.0, 1.0, 1.0]
    assert p.requires_grad


def test_set_():
    a = torch.zeros(4).to("tpu")
    b = torch.arange(6.0).to("tpu")
    a.set_(b)
    assert a.shape == (6,)
    b.add_(1)
    assert a.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_format_0d_like_torch():
    assert f"{torch.tensor(3.14159).to('tpu'):.2f}" == "3.14"
    assert f"{torch.tensor(7).to('tpu'):>3}" == "  7"
