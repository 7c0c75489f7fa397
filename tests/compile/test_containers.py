"""torchjax/compile/_containers.py: lists and dicts a jitted function takes and changes
hold, after each call, what eager Python leaves in them (Note [Containers a compiled
function changes])."""

import collections

import pytest
import torch

import torchjax


def _same(got, want):
    """The same structure, tensors close (``got``'s on tpu), other values equal."""
    got, got_spec = torch.utils._pytree.tree_flatten(got)
    want, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a.cpu(), b)
        else:
            assert a == b


def _eager_and_jit(fn, make_args, calls=3):
    """``fn`` eager on CPU and jitted on tpu, each call with fresh arguments from
    ``make_args(device, i)``: the arguments after each call, and the results."""
    jitted = torchjax.jit(fn)
    for i in range(calls):
        cpu_args = make_args("cpu", i)
        tpu_args = make_args("tpu", i)
        want = fn(*cpu_args)
        got = jitted(*tpu_args)
        _same(got, want)
        _same(tpu_args, cpu_args)
    return jitted


def test_append_to_a_list_argument_reaches_the_callers_list():
    def f(x, out):
        out.append(x * 2)
        out.append("done")
        return x + 1

    jitted = _eager_and_jit(f, lambda d, i: (torch.arange(3.0, device=d) + i, []))
    assert jitted.trace_count == 1 and jitted.cache_hits == 2


def test_setting_and_replacing_dict_entries():
    def f(x, d):
        d["k"] = x + 1
        for name in ("w", "b"):
            d[name] = d[name] - 0.5 * x.sum()
        return None

    def make(device, i):
        x = torch.arange(3.0, device=device) + i
        return x, {"w": torch.ones(2, device=device) * i, "b": torch.zeros(2, device=device)}

    jitted = _eager_and_jit(f, make)
    assert jitted.trace_count == 1 and jitted.cache_hits == 2


def test_item_assignment_and_a_swap_keep_the_callers_tensors():
    @torchjax.jit
    def f(x, lst):
        lst[0], lst[1] = lst[1], lst[0]
        lst[2] = x * 3
        return lst[1].sum()

    for i in range(2):
        a, b = torch.zeros(2, device="tpu") + i, torch.ones(2, device="tpu")
        lst = [a, b, None]
        f(torch.ones(2, device="tpu"), lst)
        assert lst[0] is b and lst[1] is a
        _same(lst[2], torch.full((2,), 3.0))
    assert f.trace_count == 1


def test_in_place_writes_to_tensors_in_containers():
    def f(lst, d):
        lst[0].add_(1)
        d["t"].mul_(2)
        return lst[0] + d["t"]

    def make(device, i):
        return [torch.full((2,), float(i), device=device)], {"t": torch.ones(2, device=device)}

    _eager_and_jit(f, make)


def test_nested_containers_moved_and_made():
    def f(d):
        d["a"]["b"].append(d["a"]["x"] * 2)
        d["moved"] = d["a"]["b"]  # the same list, reachable twice after the call
        d["new"] = [(d["a"]["x"] - 1,)]
        return d["a"]

    for device in ("cpu", "tpu"):
        inner = []
        d = {"a": {"b": inner, "x": torch.arange(3.0, device=device)}}
        out = (f if device == "cpu" else torchjax.jit(f))(d)
        assert d["moved"] is inner and d["a"]["b"] is inner and out["b"] is inner
        _same(d["new"][0][0], torch.arange(3.0) - 1)
        _same(inner, [torch.arange(3.0) * 2])


def test_a_returned_container_it_changed_is_the_callers():
    @torchjax.jit
    def f(lst, d):
        lst.append(lst[0] + 1)
        return lst, {"inner": d}

    lst, d = [torch.ones(2, device="tpu")], {"k": torch.zeros(1, device="tpu")}
    out_lst, out = f(lst, d)
    assert out_lst is lst and len(lst) == 2
    assert out["inner"] == d and out["inner"]["k"] is d["k"]


def test_a_list_that_grows_every_call_retraces_with_the_right_values():
    def f(x, history):
        history.append(x.sum())
        return len(history)

    jitted = torchjax.jit(f)
    cpu, tpu = [], []
    for i in range(3):
        x = torch.arange(3.0) + i
        assert jitted(x.to("tpu"), tpu) == f(x, cpu)
    _same(tpu, cpu)
    assert jitted.trace_count == 3  # the list's length is part of the arguments' structure


def test_python_values_in_a_dict_argument():
    def f(x, state):
        state["calls"] = state["calls"] + 1
        state.pop("drop", None)
        state["last"] = x.mean()
        return x

    jitted = torchjax.jit(f)
    cpu = {"calls": 0, "drop": 1}
    tpu = {"calls": 0, "drop": 1}
    for i in range(2):
        x = torch.arange(4.0) * i
        f(x, cpu)
        jitted(x.to("tpu"), tpu)
        assert list(tpu) == list(cpu) and tpu["calls"] == cpu["calls"]
        _same(tpu["last"], cpu["last"])


def test_deque_and_defaultdict_arguments():
    def f(x, q, d):
        q.append(x + 1)
        d["a"].append(x * 2)
        return x

    def make(device, i):
        x = torch.arange(2.0, device=device) + i
        return x, collections.deque([x], maxlen=2), collections.defaultdict(list)

    jitted = torchjax.jit(f)
    for i in range(2):
        cpu_args, tpu_args = make("cpu", i), make("tpu", i)
        f(*cpu_args)
        jitted(*tpu_args)
        _, q, d = tpu_args
        assert type(q) is collections.deque and q.maxlen == 2 and len(q) == 2
        assert d.default_factory is list
        _same(list(q), list(cpu_args[1]))
        _same(dict(d), dict(cpu_args[2]))


def test_a_loss_appended_keeps_its_gradient():
    torch.manual_seed(0)
    cpu = torch.nn.Linear(3, 1)
    tpu = torch.nn.Linear(3, 1).to("tpu")
    tpu.load_state_dict(cpu.state_dict())

    def f(model, x, losses):
        losses.append(model(x).square().mean())
        return None

    jitted = torchjax.jit(f)
    x = torch.randn(4, 3)
    cpu_losses, tpu_losses = [], []
    f(cpu, x, cpu_losses)
    jitted(tpu, x.to("tpu"), tpu_losses)
    assert tpu_losses[0].requires_grad
    cpu_losses[0].backward()
    tpu_losses[0].backward()
    _same(tpu.weight.grad, cpu.weight.grad)


def test_a_container_passed_twice_runs_eagerly():
    def f(a, b, x):
        a.append(x)
        b.append(x * 2)
        return len(b)

    jitted = torchjax.jit(f)
    x = torch.ones(2)
    for _ in range(2):
        cpu, tpu = [], []
        assert jitted(tpu, tpu, x.to("tpu")) == f(cpu, cpu, x) == 2
        _same(tpu, cpu)
    # A program traced without sharing runs eagerly for a call that shares.
    jitted(*([], []), x.to("tpu"))
    shared = []
    jitted(shared, shared, x.to("tpu"))
    _same(shared, [x, x * 2])


class Record(dict):
    """A dict subclass registered as a pytree node, as transformers' ModelOutput is."""


class Pair:
    """A class registered as a pytree node: two children, set as attributes."""

    def __init__(self, a, b):
        self.a, self.b = a, b


@pytest.fixture
def registered():
    register = torch.utils._pytree.register_pytree_node
    register(
        Record,
        lambda r: (list(r.values()), list(r)),
        lambda values, keys: Record(zip(keys, values)),
        serialized_type_name="test_containers.Record",
    )
    register(
        Pair,
        lambda p: ([p.a, p.b], None),
        lambda children, _: Pair(*children),
        serialized_type_name="test_containers.Pair",
    )
    yield
    for cls in (Record, Pair):
        torch.utils._pytree._deregister_pytree_node(cls)


def test_a_dict_subclass_that_gains_keys_gets_them(registered):
    @torchjax.jit
    def f(x, rec):
        rec["a"] = rec["a"] * 2
        rec["y"] = x + 1
        return x

    for _ in range(2):
        rec = Record(a=torch.ones(1, device="tpu"))
        f(torch.ones(2, device="tpu"), rec)
        assert type(rec) is Record and list(rec) == ["a", "y"]
        _same(dict(rec), {"a": torch.full((1,), 2.0), "y": torch.full((2,), 2.0)})
    assert f.trace_count == 1


def test_changes_that_cannot_be_written_back_are_refused(registered):
    @torchjax.jit
    def drops(x, rec):
        del rec["a"]
        return x

    @torchjax.jit
    def sets(x, pair):
        pair.a = x + 1
        return x

    x = torch.ones(2, device="tpu")
    rec = Record(a=torch.ones(1, device="tpu"))
    with pytest.raises(RuntimeError, match=r"changed argument #1 \(a Record\) in place"):
        drops(x, rec)
    assert list(rec) == ["a"]
    pair = Pair(x, x)
    with pytest.raises(RuntimeError, match=r"changed argument #1 \(a Pair\) in place"):
        sets(x, pair)
    assert pair.a is x


class Box:
    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize(
    "put, match",
    [
        (lambda y: torchjax.to_jax(y), r"a jax array of its trace \(torchjax.to_jax .*\)"),
        (Box, "a Box holding a tensor of the trace"),
    ],
    ids=["jax-array", "object"],
)
def test_what_cannot_leave_the_program_is_refused(put, match):
    @torchjax.jit
    def f(x, out):
        out.append(put(x * 2))
        return x

    out = []
    with pytest.raises(RuntimeError, match=rf"put {match} into argument #1"):
        f(torch.ones(2, device="tpu"), out)
    assert out == []


def test_repeat_and_export_refuse_a_function_that_changes_its_containers():
    def f(x, out):
        out.append(x + 1)
        x.add_(1)
        return None

    with torch.no_grad(), pytest.raises(RuntimeError, match="changes a list or dict"):
        torchjax.jit(f).repeat(2, torch.ones(2, device="tpu"), [])
    with pytest.raises(RuntimeError, match="export: the function changes a list or dict"):
        torchjax.export(f, torch.ones(2, device="tpu"), [])
    # Returned unchanged, a container is only the flat list of its arrays, as before.
    exported = torchjax.export(lambda d: d, {"a": torch.ones(2, device="tpu")})
    assert len(exported.out_avals) == 1
