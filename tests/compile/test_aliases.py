"""Compiled outputs that are views of inputs or of each other alias as on CPU (Note
[Aliased outputs of a compiled function] in torchjax/compile/_aliases.py)."""

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import torchjax

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def views(x):
    return x[1:], x.t(), x.view(-1)


def compiled(fn):
    return torch.compile(fn, backend="tpu", fullgraph=True)


def _input():
    return torch.arange(6.0).reshape(2, 3).clone()


def test_outputs_viewing_an_input_alias_it_and_the_graph_is_reused():
    cpu, tpu = _input(), _input().to("tpu")
    fn = compiled(views)
    before = torchjax.compile.dynamo_stats()
    for call in range(2):
        want, got = views(cpu), fn(tpu)
        for k, (w, g) in enumerate(zip(want, got)):
            w.add_(10 * (k + 1) + call)  # a write through each output reaches the input
            g.add_(10 * (k + 1) + call)
        torch.testing.assert_close(tpu.cpu(), cpu)
        cpu.mul_(2)  # and a write to the input shows through each output
        tpu.mul_(2)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.cpu(), w)
    after = torchjax.compile.dynamo_stats()
    assert after["graphs"] - before["graphs"] == 1
    assert after["traces"] - before["traces"] == 1
    assert after["cache_hits"] - before["cache_hits"] == 1


def test_outputs_viewing_an_input_that_requires_grad():
    cpu = _input().requires_grad_()
    tpu = _input().to("tpu").requires_grad_()
    fn = compiled(views)
    for _ in range(2):
        want, got = views(cpu), fn(tpu)
        assert all(g.requires_grad and g.grad_fn is not None for g in got)
        sum((w * (k + 1)).sum() for k, w in enumerate(want)).backward()
        sum((g * (k + 1)).sum() for k, g in enumerate(got)).backward()
        torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)
    assert fn(tpu)[0].untyped_storage().data_ptr() == tpu.untyped_storage().data_ptr()


def test_views_of_a_non_contiguous_input_alias_it():
    def fn(x):
        return x[:, 1:], x.reshape(-1)  # reshape of x.t() copies in eager

    cpu = torch.arange(6.0).reshape(3, 2).t()
    tpu = torch.arange(6.0).reshape(3, 2).to("tpu").t()
    want, got = fn(cpu), compiled(fn)(tpu)
    for w, g in zip(want, got):
        w.add_(100)
        g.add_(100)
        torch.testing.assert_close(tpu.cpu(), cpu)


def test_outputs_viewing_one_intermediate_alias_each_other():
    def fn(x):
        y = x * 2
        return y[0], y[1:].t(), y

    for requires_grad in (False, True):
        cpu = _input().requires_grad_(requires_grad)
        tpu = _input().to("tpu").requires_grad_(requires_grad)
        want, got = fn(cpu), compiled(fn)(tpu)
        with torch.no_grad():
            want[2].mul_(-1)
            got[2].mul_(-1)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.cpu(), w)
        if requires_grad:
            (want[0].sum() + want[1].sum() * 3).backward()
            (got[0].sum() + got[1].sum() * 3).backward()
            torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)


def test_in_place_writes_to_inputs_reach_the_caller():
    def fn(x, y):
        x.add_(1)
        y[0].mul_(3)
        return x[0], x + y

    cpu = (_input(), _input())
    tpu = tuple(t.to("tpu") for t in cpu)
    f = compiled(fn)
    for _ in range(2):
        want, got = fn(*cpu), f(*tpu)
        for w, g in zip((*cpu, *want), (*tpu, *got)):
            torch.testing.assert_close(g.cpu(), w)
        want[0].zero_()
        got[0].zero_()
        torch.testing.assert_close(tpu[0].cpu(), cpu[0])


def test_jit_outputs_viewing_an_argument_alias_it():
    tpu = _input().to("tpu")
    a, b, c = torchjax.jit(views)(tpu)
    c.fill_(7)
    assert tpu.cpu().eq(7).all() and a.cpu().eq(7).all()


def test_an_input_returned_whole_is_the_input():
    tpu = _input().to("tpu")
    out, view = compiled(lambda x: (x, x[0]))(tpu)
    assert out is tpu and view.untyped_storage().data_ptr() == tpu.untyped_storage().data_ptr()


def _detached(x):
    return x.detach(), x.detach().t(), x


@pytest.mark.parametrize("jit", ["compile", "torchjax.jit"])
def test_detached_outputs_leave_the_graph_and_share_memory(jit):
    cpu = _input().requires_grad_()
    tpu = _input().to("tpu").requires_grad_()
    fn = compiled(_detached) if jit == "compile" else torchjax.jit(_detached)
    want, got = _detached(cpu), fn(tpu)
    for w, g in zip(want, got):
        assert g.requires_grad == w.requires_grad and (g.grad_fn is None) == (w.grad_fn is None)
    assert got[0] is not tpu and got[2] is tpu  # eager: detach() is a new tensor
    with torch.no_grad():
        got[1].add_(1)  # a write through the detached view reaches the input
        want[1].add_(1)
    torch.testing.assert_close(tpu.detach().cpu(), cpu.detach())
    with pytest.raises(RuntimeError, match="does not require grad"):
        (got[0] * 2).sum().backward()


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 3))

    def forward(self, x):
        return self.w.detach().requires_grad_(), self.w, x * self.w


_NEW_LEAVES = {
    "detached_argument": lambda x: x.detach().requires_grad_(),
    "detached_view": lambda x: x.detach().t().requires_grad_(),
    "factory": lambda x: torch.ones(2, 3, device=x.device).requires_grad_(),
    "detached_result": lambda x: (x * 2).detach().requires_grad_(),
    "detached_parameter": _Scaled,
}


@pytest.mark.parametrize("case", sorted(_NEW_LEAVES))
def test_leaves_made_inside_come_back_as_leaves(case):
    # A leaf made inside (``x.detach().requires_grad_()``) has no history: its own .grad
    # is filled and no gradient reaches the argument or parameter it was made from.
    # (torch.compile refuses to return such a tensor, on CPU too.)
    fn = module = _NEW_LEAVES[case]
    if fn is _Scaled:
        fn = _Scaled()
        module = copy.deepcopy(fn).to("tpu")
    tpu_fn = torchjax.jit(module)
    for _ in range(2):  # the trace, then the cached entry
        cpu = _input().requires_grad_()
        tpu = cpu.detach().to("tpu").requires_grad_()
        want, got = pytree.tree_leaves(fn(cpu)), pytree.tree_leaves(tpu_fn(tpu))
        assert len(got) == len(want) >= 1
        for w, g in zip(want, got):
            assert (g.is_leaf, g.requires_grad) == (w.is_leaf, w.requires_grad)
            assert (g.grad_fn is None) == (w.grad_fn is None)
        sum(w.sum() for w in want).backward()
        sum(g.sum() for g in got).backward()
        for w, g in zip(want, got):
            if w.is_leaf:
                torch.testing.assert_close(g.grad.cpu(), w.grad)
        assert (tpu.grad is None) == (cpu.grad is None)
        if cpu.grad is not None:
            torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)
    if isinstance(fn, torch.nn.Module):
        torch.testing.assert_close(module.w.grad.cpu(), fn.w.grad)


def _write_b_read_a(a, b):
    b.mul_(3)
    return a.sum(), a * 1


@pytest.mark.parametrize("jit", ["compile", "torchjax.jit"])
def test_arguments_sharing_memory_see_each_others_writes(jit):
    fn = compiled(_write_b_read_a) if jit == "compile" else torchjax.jit(_write_b_read_a)
    for _ in range(2):  # the trace, then the cached entry
        cpu, tpu = torch.arange(4.0), torch.arange(4.0, device="tpu")
        want, got = _write_b_read_a(cpu, cpu[1:]), fn(tpu, tpu[1:])
        for w, g in zip(want, got):
            torch.testing.assert_close(g.cpu(), w)
        torch.testing.assert_close(tpu.cpu(), cpu)
    # Unshared arguments of the same shapes take a compiled program of their own.
    a, b = torch.arange(4.0, device="tpu"), torch.arange(4.0, device="tpu")[1:]
    torch.testing.assert_close(fn(a, b)[0].cpu(), torch.tensor(6.0))


def test_arguments_sharing_memory_that_are_only_read_stay_compiled():
    fn = torchjax.jit(lambda a, b: a.sum() + b.sum())
    t = torch.arange(4.0, device="tpu")
    assert fn(t, t[1:]).item() == 12.0
    entry = next(iter(fn._entries.values()))
    assert not entry.writes_shared and fn.trace_count == 1


def _dtype_views(x, z, p):
    y = x * 2  # an intermediate seen as another dtype, beside itself
    return (
        x.view(torch.int32),
        x[:, 1:].view(torch.int16),
        torch.view_as_real(z),
        torch.view_as_complex(p),
        y.view(torch.int32)[1],
        y,
    )


def _dtype_inputs(device):
    x = torch.arange(12.0).reshape(3, 4).to(device)
    z = torch.complex(torch.arange(4.0), -torch.arange(4.0)).to(device)
    p = torch.arange(8.0).reshape(4, 2).to(device)
    return x, z, p


@pytest.mark.parametrize("jit", ["compile", "torchjax.jit"])
def test_outputs_viewing_an_input_as_another_dtype_alias_it(jit):
    wrap = compiled if jit == "compile" else torchjax.jit
    cpu, tpu = _dtype_inputs("cpu"), _dtype_inputs("tpu")
    want, got = _dtype_views(*cpu), wrap(_dtype_views)(*tpu)
    assert len(got) == len(want) == 6
    for w, g in zip(want, got):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        w.add_(1)  # a write through each output reaches its input or the intermediate
        g.add_(1)
        for c, t in zip(cpu + (want[-1],), tpu + (got[-1],)):
            torch.testing.assert_close(t.cpu(), c, rtol=0, atol=0)


def test_a_view_as_real_output_keeps_the_graph():
    def fn(z):
        return torch.view_as_real(z)

    cpu = torch.complex(torch.arange(3.0), torch.ones(3)).requires_grad_()
    tpu = cpu.detach().to("tpu").requires_grad_()
    want, got = fn(cpu), compiled(fn)(tpu)
    assert got.grad_fn is not None
    (want * torch.arange(6.0).reshape(3, 2)).sum().backward()
    (got * torch.arange(6.0).reshape(3, 2).to("tpu")).sum().backward()
    torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)


_BIT_FNS = {
    "imag": lambda z: z.imag,
    "conj_imag": lambda z: z.conj().imag,
    "slice": lambda z: z[1:],
    "conj": lambda z: z.conj(),
    "resolve_conj": lambda z: z.resolve_conj(),
    "resolve_neg": lambda z: z.resolve_neg(),
    "branch_on_bit": lambda z: z * (2 if z.is_conj() or z.is_neg() else 3),
    "in_place": lambda z: z.mul_(2),
}
_BIT_INPUTS = {
    "conj": lambda z: z.conj(),
    "neg": lambda z: z._neg_view(),
    "neg_real": lambda z: z.conj().imag,  # a real tensor with the neg bit
}


def _plain(t):
    return t.resolve_conj().resolve_neg()


@pytest.mark.parametrize("jit", ["compile", "torchjax.jit"])
@pytest.mark.parametrize("bits", list(_BIT_INPUTS))
def test_arguments_with_conj_or_neg_bits(jit, bits):
    """Values, bits and aliasing of outputs as eager gives them, for arguments carrying
    conj / neg bits (Note [Arguments with conj or neg bits])."""
    ran = 0
    for name, fn in _BIT_FNS.items():
        if bits == "neg_real" and name in ("imag", "conj_imag"):
            continue  # .imag of a real tensor: an error on CPU too
        torch._dynamo.reset()
        # Not fullgraph: Dynamo breaks the graph at is_conj(), on CPU too.
        wrap = torch.compile(backend="tpu") if jit == "compile" else torchjax.jit
        z = torch.complex(torch.arange(4.0), torch.arange(4.0) - 2)
        cpu, tpu = _BIT_INPUTS[bits](z.clone()), _BIT_INPUTS[bits](z.clone().to("tpu"))
        want, got = fn(cpu), wrap(fn)(tpu)
        assert (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg()), name
        torch.testing.assert_close(_plain(got.cpu()), _plain(want), rtol=0, atol=0)
        torch.testing.assert_close(_plain(tpu.cpu()), _plain(cpu), rtol=0, atol=0)
        want.add_(1)  # a write through an aliasing output reaches the input, a copy's not
        got.add_(1)
        torch.testing.assert_close(_plain(tpu.cpu()), _plain(cpu), rtol=0, atol=0)
        ran += 1
    assert ran >= 6


_METADATA_IN_PLACE = {
    "t_": lambda x: x.t_(),
    "transpose_": lambda x: x.transpose_(0, 1),
    "unsqueeze_": lambda x: x.unsqueeze_(1),
    "squeeze_": lambda x: x.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda x: x.as_strided_((2, 2), (1, 4), 1),
}


@pytest.mark.parametrize("op", list(_METADATA_IN_PLACE))
def test_a_view_input_whose_layout_changed_in_place(op):
    """A view input after an in-place metadata change, compiled (Note [Replaying a view
    input]): Dynamo's replay of the view chain gives the old layout."""
    change = _METADATA_IN_PLACE[op]

    def fn(x):
        return x * 2, x[0]

    cpu_base = torch.arange(12.0).reshape(3, 4)
    tpu_base = cpu_base.to("tpu")
    cpu, tpu = cpu_base[1:], tpu_base[1:]
    change(cpu)
    change(tpu)
    want, got = fn(cpu), compiled(fn)(tpu)
    assert len(got) == 2
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w)
    assert (got[1].stride(), got[1].storage_offset()) == (
        want[1].stride(),
        want[1].storage_offset(),
    )
    got[1].add_(100)  # the view output still aliases the base
    want[1].add_(100)
    torch.testing.assert_close(tpu_base.cpu(), cpu_base)
