"""deepcopy, pickle and the constructor forms of tpu tensors, each compared with CPU."""

import copy
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import torchjax  # noqa: F401
from torchjax.tensor import JaxTensor


def run_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter: a segfault fails the test, not the run."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


VIEWS = {
    "slice": lambda t: t[1:],
    "offset_slice": lambda t: t[2:5],
    "transpose": lambda t: t.view(2, 3).t(),
    "expand": lambda t: t[1:2].expand(4),
    "select": lambda t: t.view(2, 3)[1],
    "strided": lambda t: t[1::2],
}


def test_deepcopy_of_views_does_not_crash():
    out = run_child(
        """
        import copy, torch, torchjax
        t = torch.arange(6.0).to("tpu")
        for v in (t[1:], t.view(2, 3).t(), t[1:2].expand(4), t.view(2, 3)[1], t[1::2]):
            d = copy.deepcopy(v)
            print(d.tolist(), tuple(d.stride()), d.storage_offset())
        """
    )
    assert out.split("\n")[0] == "[1.0, 2.0, 3.0, 4.0, 5.0] (1,) 1"
    assert len(out.strip().split("\n")) == 5


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_deepcopy_of_a_view_matches_cpu(view):
    fn = VIEWS[view]
    cpu_base = torch.arange(6.0)
    cpu = copy.deepcopy(fn(cpu_base))
    base = cpu_base.clone().to("tpu")
    tpu = copy.deepcopy(fn(base))
    assert type(tpu) is JaxTensor and tpu.device.type == "tpu"
    assert tpu.shape == cpu.shape and tpu.stride() == cpu.stride()
    assert tpu.storage_offset() == cpu.storage_offset()
    torch.testing.assert_close(tpu.cpu(), cpu)
    # The copy owns its data: writing the original leaves it alone.
    base.fill_(-1.0)
    torch.testing.assert_close(tpu.cpu(), cpu)


def test_deepcopy_keeps_aliasing_between_views_in_one_call():
    cpu_base = torch.arange(6.0)
    cpu_a, cpu_b = copy.deepcopy([cpu_base, cpu_base.view(2, 3).t()])
    cpu_b[0, 1] = 100.0
    base = torch.arange(6.0).to("tpu")
    a, b = copy.deepcopy([base, base.view(2, 3).t()])
    b[0, 1] = 100.0
    assert a.tolist() == cpu_a.tolist() and base.tolist() == list(map(float, range(6)))
    # Separate calls copy separately, as on CPU.
    c = copy.deepcopy(base[1:])
    c.fill_(7.0)
    assert base[1].item() == 1.0


def test_deepcopy_keeps_dtype_values_grad_and_attributes():
    big = torch.tensor([2**40 + 3, -(2**35)]).to("tpu")
    assert copy.deepcopy(big).tolist() == [2**40 + 3, -(2**35)]
    x = torch.ones(3, dtype=torch.float64).to("tpu").requires_grad_()
    (x * 2).sum().backward()
    x.tag = {"name": "x"}
    d = copy.deepcopy(x)
    assert d.requires_grad and d.is_leaf and d.dtype == torch.float64
    assert d.grad.tolist() == [2.0, 2.0, 2.0] and d.grad is not x.grad
    assert d.tag == {"name": "x"} and d.tag is not x.tag
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(x * 2)


def test_deepcopy_parameter_like_cpu():
    cpu = torch.nn.Parameter(torch.arange(6.0).view(2, 3).t())
    tpu = torch.nn.Parameter(torch.arange(6.0).view(2, 3).t().to("tpu"))
    for p in (cpu, tpu):
        p.grad = torch.ones_like(p)
        p.note = 1
    cd, td = copy.deepcopy(cpu), copy.deepcopy(tpu)
    assert isinstance(td, torch.nn.Parameter) and td.requires_grad
    assert td.stride() == cd.stride() and td.tolist() == cd.tolist()
    # nn.Parameter.__deepcopy__ copies neither the grad nor attributes.
    assert (td.grad is None) == (cd.grad is None) and hasattr(td, "note") == hasattr(cd, "note")


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(12.0).view(3, 4))
        self.row = self.table[1]  # a plain attribute viewing the buffer


def test_deepcopy_module_keeps_ties_and_views():
    torch.manual_seed(0)
    cpu = Tied()
    tpu = copy.deepcopy(cpu).to("tpu")
    tpu.row = tpu.table[1]
    for m in (cpu, tpu):
        d = copy.deepcopy(m)
        assert d.head.weight is d.embed.weight
        d.table[1, 0] = -5.0
        assert d.row[0].item() == -5.0  # aliasing between buffer and its view kept
        assert m.table[1, 0].item() == 4.0
    d = copy.deepcopy(tpu)
    torch.testing.assert_close(d.embed.weight.cpu(), cpu.embed.weight.detach())


def test_deepcopy_of_tensors_torch_compile_has_seen():
    out = run_child(
        """
        import copy, torch, torchjax

        class Scheduler:
            pass

        s = Scheduler()
        s.sigmas = torch.linspace(0, 1, 5).to("tpu")
        s.tail = s.sigmas[2:]
        lin = torch.nn.Linear(5, 5).to("tpu")
        f = torch.compile(lambda x: lin(x * s.tail.sum()), backend="tpu")
        x = torch.ones(2, 5).to("tpu")
        want = f(x).cpu()
        c = copy.deepcopy(s)
        m = copy.deepcopy(lin)
        same = torch.allclose(m(x * c.tail.sum()).cpu(), want)
        print(c.tail.tolist(), c.tail.storage_offset(), same)
        """
    )
    assert out.split() == ["[0.5,", "0.75,", "1.0]", "2", "True"]


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_pickle_roundtrip(view):
    cpu = VIEWS[view](torch.arange(6.0))
    tpu = VIEWS[view](torch.arange(6.0).to("tpu"))
    back = pickle.loads(pickle.dumps(tpu))
    assert type(back) is JaxTensor and back.device == tpu.device
    assert back.tolist() == cpu.tolist() and back.dtype == cpu.dtype


def test_pickle_parameter_keeps_parameter_and_attributes():
    p = torch.nn.Parameter(torch.ones(2, 2).to("tpu"))
    p.tag = "kept"
    back = pickle.loads(pickle.dumps(p))
    assert isinstance(back, torch.nn.Parameter) and back.requires_grad
    assert back.device.type == "tpu" and back.tag == "kept"
    frozen = pickle.loads(pickle.dumps(torch.nn.Parameter(p.detach(), requires_grad=False)))
    assert isinstance(frozen, torch.nn.Parameter) and not frozen.requires_grad


def test_reduce_ex_names_torch_rebuilds():
    # Files load without torchjax (map_location="cpu"): only torch's functions appear.
    fn, _ = torch.arange(3.0).to("tpu").__reduce_ex__(2)
    assert fn.__module__ == "torch._utils"
    fn, _ = torch.nn.Parameter(torch.ones(1).to("tpu")).__reduce_ex__(2)
    assert fn.__module__ == "torch._utils"


def _save_load(t, **load):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf, **load)


ROUND_TRIPS = {
    "pickle": lambda t: pickle.loads(pickle.dumps(t)),
    "copy": copy.copy,
    "save": lambda t: _save_load(t, weights_only=False),
    "save_weights_only": lambda t: _save_load(t, weights_only=True),
    "save_to_cpu": lambda t: _save_load(t, map_location="cpu", weights_only=False),
}


@pytest.mark.parametrize("trip", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("kind", ["leaf", "requires_grad", "conj"])
def test_attributes_survive_round_trips_as_on_cpu(trip, kind):
    # torch pickles a plain tensor's attributes with it (Tensor.__reduce_ex__'s state);
    # a tpu tensor dropped them, and its loaded leaf must stay a leaf.
    results = {}
    for device in ("cpu", "tpu"):
        t = torch.tensor([1.0 + 2.0j, 3.0]) if kind == "conj" else torch.arange(3.0)
        t = t.to(device)
        if kind == "conj":
            t = t.conj()
        elif kind == "requires_grad":
            t.requires_grad_()
        t.tag, t.scale = "kept", [2]
        back = ROUND_TRIPS[trip](t)
        results[device] = (
            back.tag,
            back.scale,
            back.is_leaf,
            back.requires_grad,
            back.grad_fn is None,
            back.detach().cpu().resolve_conj().tolist(),
        )
        want = "cpu" if trip == "save_to_cpu" else device
        assert back.device.type == want
    assert results["tpu"] == results["cpu"]


def test_as_subclass_tensor_is_the_tpu_tensor():
    t = torch.ones(2).to("tpu").requires_grad_()
    assert t.as_subclass(torch.Tensor) is t


@pytest.mark.parametrize("view", sorted(VIEWS) + ["whole", "int32_view"])
def test_copy_copy_aliases_as_cpu(view):
    views = {**VIEWS, "whole": lambda t: t, "int32_view": lambda t: t.view(torch.int32)}
    results = {}
    for device in ("cpu", "tpu"):
        base = torch.arange(6.0).to(device)
        t = views[view](base)
        c = copy.copy(t)
        assert type(c) is type(t) and c.dtype == t.dtype and c.stride() == t.stride()
        assert c.storage_offset() == t.storage_offset()
        base[1] = -1.0  # a write through the original shows through the copy
        results[device] = (c.tolist(), base.tolist())
    assert results["tpu"] == results["cpu"]


def test_copy_copy_of_a_parameter_shares_data():
    for device in ("cpu", "tpu"):
        p = torch.nn.Parameter(torch.ones(3).to(device))
        c = copy.copy(p)
        assert isinstance(c, torch.nn.Parameter) and c.requires_grad and c is not p
        with torch.no_grad():
            p[0] = 5.0
        assert c.tolist() == [5.0, 1.0, 1.0], device


def test_multiprocessing_pickler_moves_tpu_tensors():
    # ForkingPickler shares storages through shared memory, CPU storages only.
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (installs torch's reductions)

    t = torch.arange(4.0).to("tpu")
    p = torch.nn.Parameter(torch.ones(2).to("tpu"))
    back = pickle.loads(ForkingPickler.dumps([t, t[1:], p]))
    assert [type(b) for b in back] == [JaxTensor] * 3
    assert back[0].tolist() == [0.0, 1.0, 2.0, 3.0] and back[1].tolist() == [1.0, 2.0, 3.0]
    assert isinstance(back[2], torch.nn.Parameter) and back[2].requires_grad


def test_pickle_of_views_in_one_dump_as_cpu():
    # Plain pickle wraps each tensor's storage on its own (torch's TypedStorage reduce):
    # views in one dump do not alias after loading, on CPU either.
    results = {}
    for device in ("cpu", "tpu"):
        t = torch.arange(4.0).to(device)
        a, b = pickle.loads(pickle.dumps([t, t[1:]]))
        a[1] = -1.0
        results[device] = b.tolist()
    assert results["tpu"] == results["cpu"]


def test_class_called_like_parameter_class():
    # accelerate: param_cls = type(param); param_cls(value, requires_grad=...).to(device)
    p = torch.nn.Linear(2, 2).to("tpu").weight
    cls = type(p)
    q = cls(torch.ones(2), requires_grad=False)
    assert type(q) is torch.nn.Parameter and q.device.type == "cpu" and not q.requires_grad
    r = cls(torch.ones(2).to("tpu"), requires_grad=True)
    assert isinstance(r, torch.nn.Parameter) and r.device.type == "tpu" and r.requires_grad
    m = cls(torch.empty(2, device="meta"), False)
    assert isinstance(m, torch.nn.Parameter) and m.device.type == "meta"
    with pytest.raises(TypeError, match="unexpected keyword"):
        cls(torch.ones(1), requires_grad=True, foo=1)


def test_class_called_like_tensor_class():
    t = torch.arange(3.0).to("tpu")
    a = t.__class__(t)  # as torch.Tensor(t): an alias
    a[0] = 9.0
    assert type(a) is JaxTensor and t[0].item() == 9.0
    assert t.__class__(2, 3).shape == torch.Tensor(2, 3).shape
    assert type(t)([1.0, 2.0]).tolist() == [1.0, 2.0]


def test_accelerate_moves_tpu_parameters():
    from accelerate.utils import set_module_tensor_to_device

    torch.manual_seed(0)
    cpu = torch.nn.Linear(3, 2)
    m = copy.deepcopy(cpu).to("tpu")
    set_module_tensor_to_device(m, "weight", "cpu")
    assert m.weight.device.type == "cpu" and isinstance(m.weight, torch.nn.Parameter)
    set_module_tensor_to_device(m, "weight", "meta")
    assert m.weight.device.type == "meta"
    set_module_tensor_to_device(m, "weight", "tpu", value=cpu.weight.detach())
    assert m.weight.device.type == "tpu" and isinstance(m.weight, torch.nn.Parameter)
    x = torch.randn(4, 3)
    torch.testing.assert_close(m(x.to("tpu")).cpu(), cpu(x))
