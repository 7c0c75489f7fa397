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


def test_numpy_is_a_read_only_copy_so_writes_cannot_be_lost():
    # A CPU tensor's numpy() shares memory; a tpu tensor's cannot, so a write to the
    # array raises instead of silently not reaching the tensor.
    import numpy as np

    x = torch.arange(4.0).to("tpu")
    for a in (x.numpy(), np.asarray(x), x[1:].numpy()):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 5.0
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    c = x.cpu().numpy()
    c[0] = 5.0  # a CPU tensor's array: writable
    assert np.array(x).flags.writeable  # np.array copies


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


def test_data_assignment_of_a_non_tensor_is_cpus_type_error():
    for value in ("a", None, 3):
        raised = []
        for device in ("cpu", "tpu"):
            with pytest.raises(TypeError) as info:
                torch.zeros(2).to(device).data = value
            raised.append(str(info.value))
        assert (
            raised[0]
            == raised[1]
            == (f"Variable data has to be a tensor, but got {type(value).__name__}")
        )


_WRONG_ARGUMENTS = {
    "x + str": lambda t: t + "a",
    "str + x": lambda t: "a" + t,
    "x @ str": lambda t: t @ "a",
    "x < str": lambda t: t < "a",
    "x ** str": lambda t: t ** "a",
    "divmod": lambda t: divmod(t, "a"),
    "format": lambda t: format(t, "d"),
    "torch.where": lambda t: torch.where(t > 0, t, "a"),
    "masked_fill": lambda t: t.masked_fill(t > 0, "a"),
    "torch.add": lambda t: torch.add(t, "a"),
    "view": lambda t: t.view("a"),
    "unknown attribute": lambda t: t.foo,
}


@pytest.mark.parametrize("case", sorted(_WRONG_ARGUMENTS))
def test_wrong_argument_messages_name_the_class_tensor_as_cpu(case):
    # Note [The class name in Python's messages]: Python and torch's argument parser
    # name the object's class; a tpu tensor's is Tensor there, as a CPU tensor's.
    fn = _WRONG_ARGUMENTS[case]
    raised = []
    for device in ("cpu", "tpu"):
        with pytest.raises((TypeError, AttributeError)) as info:
            fn(torch.ones(3).to(device))
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]
    assert "JaxTensor" not in raised[1][1]


def test_class_keeps_its_qualified_name():
    t = torch.ones(2).to("tpu")
    assert type(t) is JaxTensor and type(t).__qualname__ == "JaxTensor"
    assert "JaxTensor" in repr(type(t))


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


def test_data_ptr_is_an_identity_per_storage_with_views_at_their_byte_offsets():
    # Before: every tpu tensor of offset 0 had data_ptr() 0, so libraries that find tied
    # weights by address (accelerate's offload hooks) took unrelated weights for one.
    x = torch.randn(4, 3)
    t, u = x.to("tpu"), torch.randn(4, 3).to("tpu")
    assert t.data_ptr() != 0 and t.data_ptr() != u.data_ptr()
    assert t.data_ptr() == t.data_ptr()  # stable
    for view in (lambda a: a[1], lambda a: a[:, 2], lambda a: a.t(), lambda a: a.view(torch.int32)):
        assert view(t).data_ptr() - t.data_ptr() == view(x).data_ptr() - x.data_ptr()
    z = torch.randn(3, dtype=torch.complex64)
    tz = z.to("tpu")
    assert tz.imag.data_ptr() - tz.data_ptr() == z.imag.data_ptr() - z.data_ptr() == 4
    # Distinct storages never overlap: [ptr, ptr + nbytes) ranges are disjoint.
    big = torch.zeros(1000).to("tpu")
    after = torch.zeros(1).to("tpu")
    lo, hi = sorted([big, after], key=lambda a: a.data_ptr())
    assert lo.data_ptr() + lo.numel() * lo.element_size() <= hi.data_ptr()


def test_tied_parameters_share_data_ptr_untied_ones_do_not():
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    ln = torch.nn.LayerNorm(3)
    m.to("tpu")
    ln.to("tpu")
    assert m[1].weight.data_ptr() == m[0].weight.data_ptr()
    assert len({ln.weight.data_ptr(), ln.bias.data_ptr(), m[0].weight.data_ptr()}) == 3


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[0],
        lambda t: t.view(3, 2),
        lambda t: t.unsqueeze(0),
        lambda t: t.transpose(0, 1),
        lambda t: t.detach(),
    ],
    ids=["t", "select", "view", "unsqueeze", "transpose", "detach"],
)
def test_views_under_inference_mode_are_like_cpu(view):
    # A view of a normal tensor made under inference_mode is a normal tensor sharing
    # its base's version counter (it used to raise "Cannot set version_counter for
    # inference tensor"); a view of an inference tensor is an inference tensor.
    got = {}
    for device in ("cpu", "tpu"):
        base = torch.zeros(2, 3, device=device) + torch.arange(6.0).reshape(2, 3).to(device)
        with torch.inference_mode():
            v = view(base)
            inner = view(torch.arange(6.0, device=device).reshape(2, 3))
            got[device] = (v.is_inference(), inner.is_inference(), v.shape, v.tolist())
        v.add_(1)  # outside inference mode: the write reaches the base, as on CPU
        assert base._version == v._version
        got[device] += (base.tolist(),)
    assert got["tpu"] == got["cpu"]
