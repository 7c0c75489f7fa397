"""Every private upstream API torchjax uses, exercised directly (style.md: one place)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax._compat import torch as ct
from torchjax._compat import torch_dynamo, torch_engine


def test_backend_name():
    assert ct.privateuse1_backend_name() == "tpu"


def test_elementwise_dtypes_kinds():
    a = torch.ones(2, dtype=torch.int64)
    assert ct.elementwise_dtypes(
        a, 1.5, type_promotion_kind=ct.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    ) == (torch.float32, torch.float32)
    h = torch.ones(2, dtype=torch.float16)
    assert ct.elementwise_dtypes(
        h, type_promotion_kind=ct.ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
    ) == (torch.float32, torch.float16)
    assert ct.reduction_dtypes(a, ct.REDUCTION_OUTPUT_TYPE_KIND.SAME)[1] == torch.int64


def test_decomposition_table_has_what_we_rely_on():
    aten = torch.ops.aten
    for op in (
        aten.addcmul.default,
        aten.native_dropout_backward.default,
        aten.slice_backward.default,
    ):
        assert op in ct.decomposition_table, op


def test_set_tensor_data_changes_metadata_keeps_object():
    a = torch.zeros(2).to("tpu")
    b = torch.ones(3, dtype=torch.float64).to("tpu")
    ident = id(a)
    ct.set_tensor_data(a, b)
    assert id(a) == ident and a.shape == (3,) and a.dtype == torch.float64


def test_set_math_bits():
    t = torch.zeros(2, dtype=torch.complex64)
    ct.set_math_bits(t, True, False)
    assert t.is_conj() and not t.is_neg()
    ct.set_math_bits(t, False, True)
    assert not t.is_conj() and t.is_neg()


def test_tensor_repr():
    t = torch.tensor([1.0, 2.0]).to("tpu")
    assert ct.tensor_repr(t, t.cpu()) == "tensor([1., 2.], device='tpu:0')"


def test_all_op_schemas_lists_foreach_ops():
    names = {s.name for s in ct.all_op_schemas()}
    assert "aten::_foreach_add_" in names and "aten::add" in names


def test_storage_from_pointer_does_not_own_or_copy():
    owner = torch.arange(4, dtype=torch.int32)
    s = ct.storage_from_pointer(owner.data_ptr(), torch.device("tpu", 0), 16)
    assert s.device == torch.device("tpu", 0) and s.nbytes() == 16
    assert s.data_ptr() == owner.data_ptr()


def test_rebuild_parameter_args_rebuild_a_parameter():
    fn, args = ct.rebuild_parameter_args(torch.ones(2), False, {}, {})
    p = fn(*args)
    assert isinstance(p, torch.nn.Parameter) and not p.requires_grad
    fn, args = ct.rebuild_parameter_args(torch.ones(2), True, {}, {"tag": 3})
    p = fn(*args)
    assert isinstance(p, torch.nn.Parameter) and p.tag == 3


def test_swap_tensors_wrapper_installed_and_undoable():
    import torch.utils

    installed = torch.utils.swap_tensors
    assert installed._torchjax_original is not None
    ct.uninstall_swap_tensors()
    try:
        assert torch.utils.swap_tensors is installed._torchjax_original
    finally:
        torch.utils.swap_tensors = installed
    # The swap itself: torch._C._swap_tensor_impl with a live reference held.
    a = torch.nn.Parameter(torch.ones(2))
    graph = (a * a).sum()  # saves a: use_count > 1
    b = torch.nn.Parameter(torch.zeros(3).to("tpu"))
    torch.utils.swap_tensors(a, b)
    assert a.device.type == "tpu" and a.shape == (3,) and b.shape == (2,)
    del graph


def test_call_composite_explicit_reaches_torchs_pin_memory():
    # torchjax overrides _pin_memory for CPU; the composite kernel is still torch's.
    with pytest.raises(RuntimeError, match="not an accelerator"):
        ct.call_composite_explicit(
            torch.ops.aten._pin_memory.default, torch.ones(2), torch.device("cpu")
        )


def test_call_composite_implicit_runs_the_cpp_kernel_not_torchs_python_one():
    # istft's Python CompositeImplicitAutograd kernel (torch/_refs) makes no NOLA check;
    # the C++ one does (Note [istft's window check under a trace], torchjax/ops/fft.py).
    x = torch.randn(2, 400)
    spec = torch.stft(x, 64, window=torch.hann_window(64), return_complex=True, center=False)
    args = (spec, 64, None, None, torch.hann_window(64), False, False, None, None, False)
    torch.ops.aten.istft.default.decompose(*args)
    with pytest.raises(RuntimeError, match="window overlap add min"):
        ct.call_composite_implicit(torch.ops.aten.istft.default, *args)


def test_edge_input_metadata_gives_device_and_shape():
    x = torch.randn(2, 3, requires_grad=True)
    node, nr = (x * 2).grad_fn.next_functions[0]
    assert torch_engine.edge_input_device(node, nr) == torch.device("cpu")
    assert torch_engine.edge_input_shape(node, nr) == (2, 3)


def test_custom_backward_outputs_pass_through_the_installed_check():
    # Installed at import (Note [Gradient devices of custom Functions]): the check sees
    # each custom Function's node and what its backward returned.
    patched = torch.autograd.function.BackwardCFunction.__dict__
    assert patched["apply"].__wrapped__ is not patched["apply"]
    assert patched["apply_boxed"].__wrapped__ is not patched["apply_boxed"]

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    Twice.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_destroy_library_gives_the_kernel_back():
    x = torch.ones(2)
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl("_pin_memory", lambda self, device=None: self * 0)
    assert torch.equal(torch.ops.aten._pin_memory(x), torch.zeros(2))
    ct.destroy_library(lib)
    with pytest.warns(UserWarning, match="unpinned copy"):  # torchjax's kernel again
        assert torch.equal(torch.ops.aten._pin_memory(x), x)


def test_dynamo_skip_package_undo_and_never_trace_undo():
    import torch._dynamo.trace_rules as trace_rules

    before = list(trace_rules.SKIP_DIRS)
    undo = torch_dynamo.dynamo_skip_package("json")
    assert trace_rules.check_file(json.__file__).skipped
    assert len(trace_rules.SKIP_DIRS) == len(before) + 1
    undo()
    assert trace_rules.SKIP_DIRS == before

    from torch._dynamo.testing import CompileCounter

    def f(x):
        return x + 1

    def g(x):
        return x + 2

    skipped, default = CompileCounter(), CompileCounter()
    torch_dynamo.dynamo_never_trace(f.__code__)
    torch.compile(f, backend=skipped)(torch.ones(1))
    assert skipped.frame_count == 0  # SKIP: run as plain Python
    torch_dynamo.dynamo_never_trace(g.__code__)
    torch_dynamo.dynamo_never_trace(g.__code__, undo=True)
    torch.compile(g, backend=default)(torch.ones(1))
    assert default.frame_count == 1  # DEFAULT again: compiled


def test_install_inductor_route_wraps_the_default_backends_call():
    # torch.compile(m) builds this private wrapper and Dynamo calls it once per graph.
    wrapper = torch._TorchCompileInductorWrapper("default", None, None)
    assert callable(wrapper)
    call = torch._TorchCompileInductorWrapper.__call__
    assert call.__qualname__.startswith("install_inductor_route")
    gm = torch.fx.symbolic_trace(lambda a: a + 1)
    run = wrapper(gm, [torch.ones(2, device="tpu")])  # routed: no inductor compile
    torch.testing.assert_close(run(torch.ones(2, device="tpu")).cpu(), torch.full((2,), 2.0))


def test_dataloader_worker_iter_is_the_class_that_starts_workers():
    from torch.utils.data import DataLoader

    cls = ct.dataloader_worker_iter()
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1)
    it = iter(loader)
    try:
        assert isinstance(it, cls) and next(it).tolist() == [0, 1]
    finally:
        it._shutdown_workers()


def test_clear_staging_caches_empties_trace_to_jaxpr_and_keeps_jit_executables():
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import partial_eval as pe

    from torchjax._compat import jax as cj

    f = jax.jit(lambda x: jnp.sin(x) * 2)
    f(jnp.ones(3))
    assert pe.trace_to_jaxpr.cache_info().currsize > 0
    cj.clear_staging_caches()
    assert pe.trace_to_jaxpr.cache_info().currsize == 0
    assert f._cache_size() == 1  # the C++ executable cache is left alone


def test_reset_persistent_cache_makes_a_new_directory_take_effect(tmp_path):
    import jax
    import jax.numpy as jnp

    from torchjax._compat import jax as cj

    old_dir = jax.config.jax_compilation_cache_dir
    old_time = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        cj.reset_persistent_cache()
        jax.jit(lambda v: v * 3.25 + 0.5)(jnp.ones(7)).block_until_ready()
        assert list(tmp_path.iterdir())
        jax.config.update("jax_compilation_cache_dir", None)
        cj.reset_persistent_cache()
        before = sorted(tmp_path.iterdir())
        jax.jit(lambda v: v * 4.75 - 0.5)(jnp.ones(9)).block_until_ready()
        assert sorted(tmp_path.iterdir()) == before
    finally:
        jax.config.update("jax_compilation_cache_dir", old_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_time)
        cj.reset_persistent_cache()


def test_seeding_all_generators_sees_torch_manual_seed_only():
    seen = []
    real = torch.tpu.manual_seed_all

    def spy(seed):
        seen.append(ct.seeding_all_generators())
        real(seed)

    torch.tpu.manual_seed_all = spy
    try:
        torch.manual_seed(0)
        torch.seed()
        torch.tpu.manual_seed_all(0)
    finally:
        torch.tpu.manual_seed_all = real
        torch.manual_seed(0)
    assert seen == [True, False, False]


def test_graph_task_id_and_engine_callback():
    from torchjax._compat import torch as ctorch

    assert ctorch.graph_task_id() == -1
    seen = []

    def hook(grad):
        seen.append(ctorch.graph_task_id())
        ctorch.queue_engine_callback(lambda: seen.append("end"))
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    assert seen[0] != -1 and seen[1:] == ["end"]


def test_checkpoint_recompute_inputs_pass_through_the_barrier_hook():
    import torch.utils.checkpoint as tuc

    # Both places torch 2.13 reads a checkpointed region's inputs hold the wrappers.
    assert tuc._CheckpointFrame.get_inputs.__wrapped__.__qualname__ == (
        "_CheckpointFrame.get_inputs"
    )
    assert tuc.detach_variable.__wrapped__.__module__ == "torch.utils.checkpoint"
    # Outside a trace the wrappers give torch's values: a CPU region's gradients.
    for reentrant in (False, True):
        x = torch.ones(3, requires_grad=True)
        y = tuc.checkpoint(lambda t: (t * 2).sin(), x, use_reentrant=reentrant)
        y.sum().backward()
        torch.testing.assert_close(x.grad, 2 * torch.cos(torch.full((3,), 2.0)))


def test_grad_scaler_step_is_routed_and_reads_torchs_found_inf_record():
    from torchjax._compat.torch_amp import found_inf_per_device

    method = torch.amp.GradScaler.__dict__["_maybe_opt_step"]
    assert method.__wrapped__.__qualname__ == "GradScaler._maybe_opt_step"
    # Outside a trace torch's method runs: a CPU step is skipped for an inf gradient,
    # after unscale_ recorded it where found_inf_per_device reads it.
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * torch.tensor([1.0, float("inf")])).sum()).backward()
    scaler.unscale_(opt)
    found = found_inf_per_device(scaler._per_optimizer_states[id(opt)])
    assert [t.item() for t in found] == [1.0]
    scaler.step(opt)
    assert torch.equal(w.detach(), torch.ones(2))


def test_newest_traced_values_are_the_newest_equations_inputs():
    from torchjax._compat.jax import newest_traced_values

    seen = []

    def f(x, y):
        a = jnp.sin(x)
        b = a * y
        seen.append(newest_traced_values(equations=1))
        seen.append(newest_traced_values(equations=2))
        return b

    jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
    newest, two = seen
    assert [v.aval.shape for v in newest] == [(3,), (3,)]  # mul's a and y
    assert len(two) == 3  # and sin's x
    assert newest_traced_values() == []  # outside a trace


def test_constant_value_evaluates_what_a_trace_computes_from_constants_alone():
    from torchjax._compat.jax import constant_value

    seen = {}

    def f(x):
        i = jnp.arange(6)
        causal = jnp.broadcast_to(i[:, None] >= i[None, :], (2, 1, 6, 6))
        seen["causal"] = constant_value(causal)
        seen["with x"] = constant_value(causal & (x > 0))
        seen["x"] = constant_value(x * 2)
        seen["long"] = constant_value(causal, max_equations=1)
        return x

    jax.jit(f)(jnp.ones(6))
    want = np.broadcast_to(np.tri(6, dtype=bool), (2, 1, 6, 6))
    np.testing.assert_array_equal(np.asarray(seen["causal"]), want)
    assert seen["with x"] is None and seen["x"] is None and seen["long"] is None
    assert constant_value(jnp.ones(3)) is None  # a concrete array: nothing to evaluate


def test_checkpoint_region_names_the_frame_in_its_forward_and_its_recomputation():
    from torchjax._compat.torch_checkpoint import checkpoint_region

    seen = []

    def region(x):
        seen.append(checkpoint_region())
        return (x * 2).sin()

    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        region(x)  # another's hooks
    y = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    y.sum().backward()  # runs the region again
    outside, forward, again = seen
    assert outside is None and checkpoint_region() is None
    assert type(forward[0]).__name__ == "_CheckpointFrame" and forward[1:] == (False, None)
    assert again[0] is forward[0] and again[1] is True and again[2] is not None


def test_backward_entry_wraps_torchs_for_backward_and_grad():
    from torch.autograd import graph

    # backward() and autograd.grad call torch.autograd's name; both names hold the wrapper.
    entry = torch.autograd._engine_run_backward
    assert entry is graph._engine_run_backward
    original = entry.__wrapped__
    assert original.__module__ == "torch.autograd.graph"
    # The wrapper passes torch's entry its arguments, with multithreading off.
    x = torch.ones(2, requires_grad=True)
    (g,) = torch.autograd.grad((x * 3).sum(), x)
    assert g.tolist() == [3.0, 3.0] and x.grad is None
    assert torch.autograd.is_multithreading_enabled()


def test_current_autograd_node():
    assert ct.current_autograd_node() is None
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sin()
    y.register_hook(lambda g: seen.append(ct.current_autograd_node()))
    y.sum().backward()
    assert seen == [y.grad_fn]
    (accumulate, _), _ = seen[0].next_functions[0][0].next_functions
    assert accumulate.variable is x


def _doubling(on_backward):
    """An autograd Function doubling its input whose backward calls ``on_backward()``."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            on_backward()
            return g * 2

    return Probe


def test_engine_callback_runs_at_the_end_of_backward():
    seen = []
    assert not ct.in_graph_task()

    def on_backward():
        seen.append(ct.in_graph_task())
        ct.queue_engine_callback(lambda: seen.append("end"))

    x = torch.ones(2, requires_grad=True)
    _doubling(on_backward).apply(x).sum().backward()
    assert seen == [True, "end"]


def test_backward_keeps_graph_tells_retain_graph():
    seen = []
    Probe = _doubling(lambda: seen.append(ct.backward_keeps_graph()))
    x = torch.ones(2, requires_grad=True)
    y = Probe.apply(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    Probe.apply(x).sum().backward(create_graph=True)
    assert seen == [True, False, True]


@pytest.mark.parametrize(
    "host",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(2**40, dtype=np.int64),
        np.array([True, False]),
        np.zeros((0, 3), np.float64),
        np.array([1.5, -2.25], dtype=jnp.bfloat16),
    ],
    ids=["f32", "int64-0d", "bool", "empty", "bf16"],
)
@pytest.mark.parametrize("named", [False, True])
def test_put_host_is_device_puts_result(host, named):
    import jax

    from torchjax._compat import jax as cj

    device = jax.devices()[0] if named else None
    with jax.enable_x64(True):
        want = jax.device_put(host, device)
        got = cj.put_host(host, device)
    assert (got.dtype, got.shape, got.weak_type) == (want.dtype, want.shape, want.weak_type)
    assert got.committed == want.committed == named
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), host)


def test_put_host_is_an_explicit_transfer_for_transfer_guards():
    import jax

    from torchjax._compat import jax as cj

    host = np.ones(3, np.float32)
    with jax.transfer_guard_host_to_device("disallow"):  # implicit ones only
        assert cj.put_host(host).shape == (3,)
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        with pytest.raises(Exception, match="host-to-device"):
            jax.device_put(host)
        with pytest.raises(Exception, match="host-to-device"):
            cj.put_host(host)


def test_put_host_outside_mesh_puts_as_outside_any_mesh():
    import jax

    from torchjax._compat import jax as cj

    host = np.arange(3, dtype=np.int32)
    want = cj.put_host(host)
    with torchjax.mesh((1,), ("x",)):
        assert not jax.sharding.get_abstract_mesh().empty
        got = cj.put_host(host, outside_mesh=True)
    assert (got.committed, got.sharding) == (want.committed, want.sharding)
    np.testing.assert_array_equal(np.asarray(got), host)


def test_put_host_leaves_other_inputs_to_device_put():

    from torchjax._compat import jax as cj

    got = cj.put_host([np.ones(2, np.float32)])  # a pytree, as jax.device_put takes
    assert isinstance(got, list) and got[0].shape == (2,)


def test_no_private_torch_or_jax_api_outside_compat():
    # Private names (a component starting with "_") of torch and jax are reached through
    # torchjax/_compat only. Allowed: torch._check and torch._assert_async (documented),
    # Tensor._make_wrapper_subclass (the documented way to make a wrapper subclass),
    # op names under torch.ops, and torch.testing._internal (the OpInfo database) in
    # torchjax/testing.
    import ast
    import pathlib

    allowed = ("torch._check", "torch._assert_async", "torch.Tensor._make_wrapper_subclass")
    root = pathlib.Path(torchjax.__file__).parent

    def dotted(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None

    found, scanned = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "_compat":
            continue
        scanned += 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names = [dotted(node)]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in filter(None, names):
                parts = name.split(".")
                if parts[0] not in ("torch", "jax") or parts[1:2] == ["ops"]:
                    continue
                if name.startswith(allowed):
                    continue
                if rel.parts[0] == "testing" and name.startswith("torch.testing._internal"):
                    continue
                if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                    found.append(f"{rel}:{node.lineno} {name}")
    assert scanned > 100
    assert found == []


def test_dispatcher_types_and_kernel_query():
    assert isinstance(torch.ops.aten.add.Tensor, ct.OpOverload)
    assert isinstance(torch.ops.aten.add, ct.OpOverloadPacket)
    assert isinstance(torch.ops.aten.add.Tensor._schema, ct.FunctionSchema)
    assert ct.has_composite_implicit_kernel(torch.ops.aten.scaled_dot_product_attention.default)
    assert not ct.has_composite_implicit_kernel(torch.ops.aten.add.Tensor)


def test_disabled_torch_function_impl_is_torchs():
    assert torchjax.JaxTensor.__torch_function__ is ct.disabled_torch_function_impl
    assert ct.disabled_torch_function_impl is torch._C._disabled_torch_function_impl


def test_exclude_dispatch_key_skips_autocast():
    x = torch.ones(2, 2).to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert torch.mm(x, x).dtype == torch.bfloat16
        with ct.exclude_dispatch_key("AutocastPrivateUse1"):
            assert torch.mm(x, x).dtype == torch.float32


def test_device_guard_is_the_privateuse1_guard():
    guard = ct.DeviceGuard()
    assert guard.type_() == torch._C._autograd.DeviceType.PrivateUse1
    with torch.device("tpu"):
        assert torch.empty(1).device.type == "tpu"


def test_create_empty_tensor_is_a_plain_tpu_tensor_without_memory():
    t = ct.create_empty_tensor((2, 3), torch.bfloat16)
    assert type(t) is torch.Tensor
    assert t.device.type == "tpu" and t.shape == (2, 3) and t.dtype == torch.bfloat16


def test_new_untyped_storage_is_torchs_constructor():
    s = ct.new_untyped_storage(torch.UntypedStorage, 8)
    assert s.device.type == "cpu" and s.nbytes() == 8


def test_fake_tensor_mode_class():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert torch_dynamo.fake_tensor_mode_class() is FakeTensorMode


def test_optimizer_scalar_dtype_is_the_step_counters():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    opt.zero_grad()
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    step = next(iter(opt.state.values()))["step"]
    assert ct.optimizer_scalar_dtype() == step.dtype == torch.float32


def test_init_group_wrapper_sees_fresh_parameters_and_the_lists_filled():
    # torch's optimizers make a group's state in _init_group and step from the lists it
    # fills: the wrapper's ``after`` gets the parameters without state and those lists.
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w])
    assert ct.has_init_group(opt)
    assert not ct.has_init_group(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(2))]))
    seen = []
    ct.wrap_init_group(opt, lambda o, group, fresh, lists: seen.append((fresh, lists)))
    w.grad = torch.ones(2)
    opt.step()
    opt.step()
    (fresh, lists), (later, _) = seen
    assert fresh == [w] and later == []
    assert any(x and x[0] is opt.state[w]["step"] for x in lists)
    ct.unwrap_init_group(opt)
    assert "_init_group" not in vars(opt)


def test_active_fake_mode_is_the_mode_entered():
    FakeTensorMode = torch_dynamo.fake_tensor_mode_class()
    assert torch_dynamo.active_fake_mode() is None
    with FakeTensorMode() as mode:
        assert torch_dynamo.active_fake_mode() is mode
    assert torch_dynamo.active_fake_mode() is None


def test_cpp_meta_kernels_turns_off_the_python_dispatcher():
    from torch._dispatch.python import enable_python_dispatcher

    x = torch.empty((), device="meta")
    with enable_python_dispatcher():
        python_rule = x.expand(1).stride()  # the Python meta rule: (1,) in torch 2.13
        with ct.cpp_meta_kernels():
            assert x.expand(1).stride() == torch.empty(()).expand(1).stride() == (0,)
    assert python_rule in ((0,), (1,))


def test_eager_dispatch_leaves_the_fake_mode():
    FakeTensorMode = torch_dynamo.fake_tensor_mode_class()
    with FakeTensorMode():
        assert torch_dynamo.active_fake_mode() is not None
        with ct.eager_dispatch():
            assert torch_dynamo.active_fake_mode() is None
            assert type(torch.ones(2)) is torch.Tensor


def test_is_fake_tensor():
    FakeTensorMode = torch_dynamo.fake_tensor_mode_class()
    with FakeTensorMode():
        fake = torch.empty(2)
    assert torch_dynamo.is_fake_tensor(fake) and not torch_dynamo.is_fake_tensor(torch.empty(2))


def test_fake_graph_breaks_include_a_data_dependent_output_shape():
    FakeTensorMode = torch_dynamo.fake_tensor_mode_class()
    with FakeTensorMode(), pytest.raises(torch_dynamo.fake_graph_breaks()):
        torch.nonzero(torch.empty(3))


def test_fake_tensor_logger_logs_a_failing_meta_kernel():
    import logging

    FakeTensorMode = torch_dynamo.fake_tensor_mode_class()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = torch_dynamo.fake_tensor_logger()
    logger.addHandler(handler)
    try:
        with FakeTensorMode(), pytest.raises(RuntimeError):
            torch.mm(torch.empty(2, 3), torch.empty(4, 5))
    finally:
        logger.removeHandler(handler)
    assert any("failed while attempting to run meta" in r.getMessage() for r in records)


def test_pytree_is_torchs():
    assert ct.pytree.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]


def test_setup_privateuse1_python_backend_made_tpu_a_device():
    assert torch.device("tpu").type == "tpu"
    assert torch.ones(1).to("tpu").device == torch.device("tpu", 0)
    assert torch._C._get_privateuse1_backend_name() == "tpu"


def test_rebuild_device_tensor_args_rebuild_on_tpu():
    fn, args = ct.rebuild_device_tensor_args(torch.arange(3.0), torch.float32, "tpu", True)
    t = fn(*args)
    assert t.device.type == "tpu" and t.requires_grad
    assert torch.equal(t.detach().cpu(), torch.arange(3.0))


def test_install_to_dlpack_routes_tpu_tensors_only():
    import torch.utils.dlpack as dlpack

    from torchjax import _patches

    assert _patches.is_recorded("torch.utils.dlpack.to_dlpack")
    ct.install_to_dlpack(lambda t: None)  # installed already: a no-op
    x = torch.arange(3.0)
    assert torch.equal(torch.from_dlpack(dlpack.to_dlpack(x)), x)
    t = torch.arange(3.0).to("tpu")
    capsule = dlpack.to_dlpack(t)
    assert torch.equal(torch.from_dlpack(capsule), torch.arange(3.0))


def test_rebuild_tensor_args_view_a_storage():
    x = torch.arange(6.0)
    fn, args = ct.rebuild_tensor_args(x.untyped_storage(), 2, (2,), (2,), False, x.dtype)
    y = fn(*args)
    assert y.dtype == x.dtype and y.tolist() == [2.0, 4.0]
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    # Dtypes TypedStorage lacks go through _rebuild_tensor_v3 with the dtype (torch's own
    # reduce does the same; a file load wraps the storage before the call).
    u = x.to(torch.uint16)
    fn, args = ct.rebuild_tensor_args(u.untyped_storage(), 0, (6,), (1,), False, u.dtype)
    assert fn is torch._utils._rebuild_tensor_v3 and args[-1] is torch.uint16


def test_install_load_scope_clears_a_failed_loads_location(tmp_path):
    import io

    import torch.serialization as serialization

    from torchjax import _patches

    assert _patches.is_recorded("torch.load")
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf)
    buf.seek(0)

    def broken(storage, location):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        torch.load(buf, map_location=broken, weights_only=False)
    assert getattr(serialization._serialization_tls, "map_location", None) is None


def test_install_module_moves_keeps_parameters_moved_off_tpu():
    from torchjax import _patches

    assert _patches.is_recorded("torch.nn.Module._apply")
    m = torch.nn.Linear(2, 2).to("tpu")
    weight = m.weight
    out = m(torch.ones(1, 2).to("tpu"))  # a graph that holds the weight
    m.cpu()
    assert m.weight is weight and m.weight.device.type == "cpu"
    del out


def test_untyped_storage_of_and_awaits_legacy_bytes():
    import warnings

    x = torch.arange(3.0)
    typed = torch.TypedStorage(wrap_storage=x.untyped_storage(), dtype=x.dtype, _internal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TypedStorage deprecation warning
        assert ct.untyped_storage_of(typed).data_ptr() == x.untyped_storage().data_ptr()
    assert ct.untyped_storage_of(x.untyped_storage()) is not None
    assert not ct.awaits_legacy_bytes(x.untyped_storage())
    # What torch's legacy loader sets on the storages it has not filled yet.
    s = torch.UntypedStorage(4)
    s._torch_load_uninitialized = True
    assert ct.awaits_legacy_bytes(s)


def test_plain_eager_is_false_inside_a_trace_and_under_a_mesh():
    import jax

    from torchjax._compat import jax as cj

    assert cj.plain_eager()
    seen = []
    jax.jit(lambda x: seen.append(cj.plain_eager()) or x)(np.ones(2))
    jax.make_jaxpr(lambda x: seen.append(cj.plain_eager()) or x)(np.ones(2))
    assert seen == [False, False]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with jax.set_mesh(mesh):
        assert not cj.plain_eager()
    assert cj.plain_eager()


def test_backends_initialized_after_a_tpu_op():
    from torchjax._compat.jax import backends_initialized

    torch.ones(2, device="tpu").sum().item()
    assert backends_initialized() is True


def test_autograd_function_apply_is_dynamos_op_for_custom_functions():
    op = ct.autograd_function_apply()
    assert isinstance(op, torch._ops.HigherOrderOperator)
    assert op.name() == "autograd_function_apply"


def test_trace_of_names_a_tracers_trace():
    from torchjax._compat import jax as cj

    seen = []

    def f(a, b):
        seen.append((cj.trace_of(a), cj.trace_of(b)))
        return a + b

    jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(2))
    ((ta, tb),) = seen
    assert ta is not None and ta is tb
    assert cj.trace_of(jnp.ones(2)) is None


def test_saved_tensors_hooks_active_follows_the_hooks_context():
    assert not ct.saved_tensors_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert ct.saved_tensors_hooks_active()
    assert not ct.saved_tensors_hooks_active()


def test_saved_tensors_hooks_enabled_follows_the_disable_context():
    assert ct.saved_tensors_hooks_enabled()
    with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
        assert not ct.saved_tensors_hooks_enabled()


def test_delayed_error_raises_only_when_differentiated():
    a, b = ct.delayed_error("no second derivative here", [torch.ones(2), None])
    assert b is None and a.requires_grad
    with pytest.raises(RuntimeError, match="no second derivative here"):
        a.sum().backward()


def test_active_proxy_mode_is_make_fxs_mode():
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    def fn(t):
        seen.append(torch_dynamo.active_proxy_mode())
        return t + 1

    assert torch_dynamo.active_proxy_mode() is None
    make_fx(fn)(torch.ones(2))
    assert type(seen[0]).__name__ == "ProxyTorchDispatchMode"


def test_weak_float_promotes_as_a_python_float_inside_a_trace():
    from torchjax._compat.jax import weak_float

    @jax.jit
    def f(x, s):
        w = weak_float(s)
        return x * w, w + 1.0, w

    with jax.enable_x64(True):
        y, w1, w = f(jnp.ones(3, jnp.bfloat16), np.float32(0.5))
    assert y.dtype == jnp.bfloat16 and w1.dtype == jnp.float64 and w.dtype == jnp.float64
    assert w.weak_type and float(w) == 0.5


def test_dynamo_backend_register_and_unregister():
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    def compiler(gm, example_inputs):
        return gm.forward

    name = "torchjax_test_backend"
    assert torch_dynamo.register_dynamo_backend(name, compiler)
    assert not torch_dynamo.register_dynamo_backend(name, lambda gm, xs: gm.forward)
    assert lookup_backend(name) is compiler
    torch_dynamo.unregister_dynamo_backend(name, compiler)
    with pytest.raises(InvalidBackend):
        lookup_backend(name)


def test_host_copy_leaves_no_host_copy_cached_on_the_array():
    # A read that copies (every read off a TPU; on CPU, an array of several shards) made
    # jax keep the NumPy copy on the array: a model saved on the chip stayed in host
    # memory. Two simulated CPU devices give a copying read here.
    from tests._child import run_python

    out = run_python(
        """
        import numpy as np, jax, torch
        from jax.sharding import NamedSharding, PartitionSpec as P
        import torchjax
        from torchjax import sharding as ts
        from torchjax._compat.jax import host_copy

        sharding = NamedSharding(jax.make_mesh((2,), ("x",)), P("x"))
        a = jax.device_put(np.arange(8.0), sharding)
        np.asarray(a)
        assert a._npy_value is not None  # jax's cache: the premise
        b = jax.device_put(np.arange(8.0), sharding)
        got = host_copy(b)
        assert got.tolist() == list(range(8)) and b._npy_value is None
        assert not got.flags.writeable
        one = jax.numpy.arange(3.0)  # one device: on CPU a view of the device buffer
        assert not host_copy(one).flags.writeable
        assert host_copy(a) is not None and a._npy_value is not None  # kept as it was
        with torchjax.mesh((2,), ("x",)):
            t = ts.shard(torch.arange(8.0).to("tpu"), P("x"))
        assert t.cpu().tolist() == list(range(8)) and t.sum().item() == 28
        assert t._value()._npy_value is None
        print("ok")
        """,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_dynamo_frame_id_names_the_compiled_function():
    # One id per function, the same over its recompiles.
    from torchjax._compat.torch_dynamo import dynamo_frame_id

    ids = []

    def backend(gm, example_inputs):
        ids.append(dynamo_frame_id(gm))
        return gm.forward

    def f(x):
        return x * 2

    compiled = torch.compile(f, backend=backend)
    compiled(torch.ones(2))
    compiled(torch.ones(2, dtype=torch.float64))  # a dtype guard fails: a recompile
    assert len(ids) == 2 and ids[0] is not None and ids[0] == ids[1]


def test_module_call_patch_is_set_and_undone():
    from tests._child import run_python

    # In a child: the patch is process-wide, and made once per process.
    out = run_python(
        """
        import torch
        import torchjax
        from torchjax import _patches
        from torchjax._compat import torch_modules

        original = torch.nn.Module.__dict__["__call__"]
        assert torch_modules.module_call() is original is torch.nn.Module._wrapped_call_impl
        seen = []

        def make(orig):
            def __call__(self, *args, **kwargs):
                seen.append(type(self).__name__)
                return orig(self, *args, **kwargs)

            return __call__

        torch_modules.set_module_call(make)
        assert _patches.is_recorded("torch.nn.Module.__call__")
        assert torch_modules.module_call() is original
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).shape == (1, 2)
        assert seen == ["Linear"]
        torch_modules.set_module_call(None)
        assert torch.nn.Module.__dict__["__call__"] is original
        assert not _patches.is_recorded("torch.nn.Module.__call__")
        print("ok")
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_module_call_patch_is_in_force_only_in_fused_mode():
    from tests._child import run_python

    out = run_python(
        """
        import torch
        import torchjax
        original = torch.nn.Module._wrapped_call_impl
        assert torch.nn.Module.__dict__["__call__"] is original  # import changes nothing
        with torchjax.fused():
            assert torch.nn.Module.__dict__["__call__"] is not original
            names = [p.name for p in torchjax.patches()]
            assert "torch.nn.Module.__call__" in names
        # undone when fused mode turns off: Dynamo does not inline torchjax's __call__
        assert torch.nn.Module.__dict__["__call__"] is original
        assert "torch.nn.Module.__call__" not in [p.name for p in torchjax.patches()]
        with torchjax.fused():
            assert torch.nn.Module.__dict__["__call__"] is not original
        torchjax.uninstall()
        assert torch.nn.Module.__dict__["__call__"] is original
        with torchjax.fused():
            assert torch.nn.Module.__dict__["__call__"] is original  # not made again
        print("ok")
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_foreach_type_lists_gate_torchs_foreach_defaults(monkeypatch):
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    from torchjax._compat.torch_optim import foreach_type_lists

    optim_types, util_types = foreach_type_lists()
    assert optim_types is optimizer._foreach_supported_types
    assert util_types is _foreach_utils._foreach_supported_types
    p = torch.zeros(2, device="tpu")
    assert optimizer._default_to_fused_or_foreach([p], False) == (False, True)
    assert _foreach_utils._has_foreach_support([p], p.device)
    # Without torchjax's entry: torch's own answer for a tensor subclass.
    monkeypatch.setattr(optimizer, "_foreach_supported_types", [torch.Tensor, torch.nn.Parameter])
    monkeypatch.setattr(_foreach_utils, "_foreach_supported_types", [torch.Tensor])
    assert optimizer._default_to_fused_or_foreach([p], False) == (False, False)
    assert not _foreach_utils._has_foreach_support([p], p.device)


def test_calls_run_no_hooks_is_torchs_fast_path():
    # torchjax/_compat/torch_modules.py: whether calling a module runs its forward alone
    # (Note [A module walked once within a block] in torchjax/compile/_state.py).
    from torchjax._compat.torch_modules import calls_run_no_hooks

    m = torch.nn.Linear(2, 2)
    assert calls_run_no_hooks(m)
    checked = 0
    for register in (
        lambda: m.register_forward_hook(lambda *a: None),
        lambda: m.register_forward_pre_hook(lambda *a: None),
        lambda: m.register_full_backward_hook(lambda *a: None),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
        lambda: torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None),
    ):
        handle = register()
        try:
            assert not calls_run_no_hooks(m)
        finally:
            handle.remove()
        assert calls_run_no_hooks(m)
        checked += 1
    assert checked == 5

    class Own(torch.nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert not calls_run_no_hooks(Own(2, 2))
    m.compile()  # its calls go through torch.compile
    assert not calls_run_no_hooks(m)
