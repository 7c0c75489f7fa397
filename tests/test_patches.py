"""torchjax/_patches.py: every process-wide change is listed in Note [Process-wide
changes], version-checked when made, and undone by torchjax.uninstall()."""

import re
import subprocess
import sys
import textwrap

import pytest

import torchjax
from tests._child import once_per_run
from torchjax import _patches


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_uninstall_restores_every_original():
    out = _run(
        """
        import sys
        import torch
        import torch.utils.dlpack as dlpack
        import torch._dynamo.trace_rules as trace_rules
        from transformers import modeling_utils
        from transformers.integrations.moe import ExpertsInterface
        from transformers import Trainer
        from transformers.generation.utils import GenerationMixin
        from accelerate.state import PartialState
        import accelerate.accelerator as acc_accelerator
        import accelerate.checkpointing as acc_checkpointing
        import accelerate.utils.offload as acc_offload
        import accelerate.utils.other as acc_other
        import transformers.integrations.accelerate as hf_accelerate
        import kernels
        from kernels.backends import CPU, TPU, _backend
        assert _backend() == CPU()
        import safetensors.torch as st
        from accelerate.utils.dataclasses import DynamoBackend
        from huggingface_hub.serialization import _torch as hub_torch
        st_load_file, st_save_file = st.load_file, st.save_file
        accelerate_before = {
            "save_state": acc_accelerator.save_accelerator_state,
            "load_state": acc_accelerator.load_accelerator_state,
            "load_model": acc_checkpointing.load_model,
            "clean": acc_other.clean_state_dict_for_safetensors,
            "getitem": acc_offload.OffloadedWeightsLoader.__dict__["__getitem__"],
            "max_memory": hf_accelerate.accelerate_max_memory,
        }

        cls = modeling_utils.PreTrainedModel
        before = {
            "dlpack": dlpack.to_dlpack, "torch_dlpack": torch.to_dlpack,
            "load": cls.__dict__["_load_pretrained_model"],
            "from_pretrained": cls.__dict__["from_pretrained"],
            "safe_save_file": modeling_utils.safe_save_file,
            "hub_size": hub_torch.get_torch_storage_size,
            "hub_id": hub_torch.get_torch_storage_id,
            "default_device": PartialState.__dict__["default_device"],
            "save_rng": Trainer.__dict__["_save_rng_state"],
            "generate": GenerationMixin.__dict__["generate"],
            "prepare_static": GenerationMixin.__dict__["_prepare_static_cache"],
            "load_rng": Trainer.__dict__["_load_rng_state"],
            "swap": torch.utils.swap_tensors,
            "torch_load": torch.load,
            "set_metadata": torch._utils.set_tensor_metadata,
            "nested_tensor": torch.nested.nested_tensor,
            "as_nested_tensor": torch.nested.as_nested_tensor,
            "inductor_call": torch._TorchCompileInductorWrapper.__call__,
            "dl_init": torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__,
            "apply": torch.nn.Module.__dict__["_apply"],
            "swap_flag": torch.__future__.get_swap_module_params_on_conversion,
            "acc_empty_cache": torch.accelerator.empty_cache,
            "acc_memory_stats": torch.accelerator.memory.memory_stats,
            "acc_synchronize": torch.accelerator.synchronize,
            "saved_enter": torch.autograd.graph.saved_tensors_hooks.__dict__["__enter__"],
            "bcf_apply": torch.autograd.function.BackwardCFunction.__dict__["apply"],
            "bcf_apply_boxed": torch.autograd.function.BackwardCFunction.__dict__["apply_boxed"],
            "run_backward": torch.autograd.graph._engine_run_backward,
            "ckpt_inputs": torch.utils.checkpoint._CheckpointFrame.__dict__["get_inputs"],
            "ckpt_detach": torch.utils.checkpoint.detach_variable,
            "scaler_step": torch.amp.GradScaler.__dict__["_maybe_opt_step"],
            "hooks_off": torch._C._autograd._saved_tensors_hooks_disable,
            "hooks_on": torch._C._autograd._saved_tensors_hooks_enable,
        }
        meta_path = list(sys.meta_path)
        skip_dirs = list(trace_rules.SKIP_DIRS)
        experts = dict(ExpertsInterface._global_mapping)
        has_cpu_pin = torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_pin_memory", "CPU")
        loaders = list(torch.serialization._package_registry)
        from torch._dynamo.backends import registry as dynamo_registry
        dynamo_backends = dict(dynamo_registry._COMPILER_FNS)
        from torch._dynamo.variables.optimizer import OptimizerVariable
        set_capturable = OptimizerVariable.__dict__["_set_capturable"]
        from torch.optim import optimizer as optim_optimizer
        from torch.utils import _foreach_utils
        foreach_types = (list(optim_optimizer._foreach_supported_types),
                         list(_foreach_utils._foreach_supported_types))
        import io
        buf = io.BytesIO()
        torch.save({"w": torch.arange(3.0)}, buf)

        import torchjax
        import torchjax.compile._dynamo  # what torch.compile(backend="tpu") loads
        from torchjax.integrations.transformers import register_experts
        register_experts()

        m = torch.nn.Linear(2, 1).to("tpu")
        opt = torch.optim.Adam(m.parameters(), lr=0.1)

        @torchjax.jit
        def step(x):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()

        step(torch.ones(3, 2, device="tpu"))
        assert opt.param_groups[0]["capturable"]
        assert "_init_group" in vars(opt)
        assert all(st["step"].dtype == torch.float64 for st in opt.state.values())
        names = [p.name for p in torchjax.patches()]
        print("names", names)
        assert dlpack.to_dlpack is not before["dlpack"]
        from torchjax.tensor._tensor import JaxTensor
        assert optim_optimizer._foreach_supported_types == [*foreach_types[0], JaxTensor]
        assert _foreach_utils._foreach_supported_types == [*foreach_types[1], JaxTensor]
        assert optim_optimizer._default_to_fused_or_foreach(
            list(m.parameters()), False) == (False, True)
        assert _backend() == TPU() and sys.modules["torch.backends.tpu"] is torch.backends.tpu
        import inspect
        assert torch.load is not before["torch_load"]
        saved_hooks = torch.autograd.graph.saved_tensors_hooks
        assert saved_hooks.__dict__["__enter__"] is not before["saved_enter"]
        assert torch.autograd._engine_run_backward is not before["run_backward"]
        bcf = torch.autograd.function.BackwardCFunction
        assert bcf.__dict__["apply"] is not before["bcf_apply"]
        assert bcf.__dict__["apply_boxed"] is not before["bcf_apply_boxed"]
        frame = torch.utils.checkpoint._CheckpointFrame
        assert frame.__dict__["get_inputs"] is not before["ckpt_inputs"]
        assert torch.utils.checkpoint.detach_variable is not before["ckpt_detach"]
        assert torch.amp.GradScaler.__dict__["_maybe_opt_step"] is not before["scaler_step"]
        assert torch._C._autograd._saved_tensors_hooks_disable is not before["hooks_off"]
        assert torch._C._autograd._saved_tensors_hooks_enable is not before["hooks_on"]
        assert torch.accelerator.empty_cache is not before["acc_empty_cache"]
        assert torch.accelerator.memory.memory_stats is not before["acc_memory_stats"]
        assert inspect.signature(torch.accelerator.memory.memory_stats) == inspect.signature(
            before["acc_memory_stats"])
        assert inspect.signature(torch.load) == inspect.signature(before["torch_load"])
        assert cls.__dict__["_load_pretrained_model"] is not before["load"]
        assert PartialState().default_device == torch.device("tpu", 0)
        assert acc_accelerator.save_accelerator_state is not accelerate_before["save_state"]
        assert acc_offload.OffloadedWeightsLoader.__getitem__ is not accelerate_before["getitem"]
        assert inspect.signature(Trainer._save_rng_state) == inspect.signature(
            before["save_rng"])
        assert GenerationMixin.generate is not before["generate"]
        assert inspect.signature(GenerationMixin.generate) == inspect.signature(
            before["generate"])
        assert GenerationMixin._prepare_static_cache is not before["prepare_static"]
        assert inspect.signature(GenerationMixin._prepare_static_cache) == inspect.signature(
            before["prepare_static"])
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_pin_memory", "CPU")
        assert trace_rules.SKIP_DIRS != skip_dirs
        assert inspect.signature(torch.nn.Module._apply) == inspect.signature(before["apply"])
        assert inspect.signature(torch.nested.nested_tensor) == inspect.signature(
            before["nested_tensor"])
        def nested_to_tpu_refusal():
            try:
                torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)]).to("tpu")
            except NotImplementedError as e:
                return str(e)

        assert nested_to_tpu_refusal().startswith("torchjax")
        buf.seek(0)
        assert torch.load(buf, map_location="tpu")["w"].device.type == "tpu"
        assert st.load_file is not st_load_file
        assert inspect.signature(st.load_file) == inspect.signature(st_load_file)
        assert st.save_file is not st_save_file
        assert inspect.signature(st.save_file) == inspect.signature(st_save_file)
        assert DynamoBackend("TPU").value == "TPU"

        torchjax.uninstall()
        assert st.load_file is st_load_file and st.save_file is st_save_file
        assert "_missing_" not in DynamoBackend.__dict__
        try:
            DynamoBackend("TPU")
            raise AssertionError("DynamoBackend took TPU after uninstall")
        except ValueError:
            pass
        assert torchjax.patches() == []
        assert GenerationMixin.__dict__["generate"] is before["generate"]
        assert GenerationMixin.__dict__["_prepare_static_cache"] is before["prepare_static"]
        assert dlpack.to_dlpack is before["dlpack"]
        assert torch.to_dlpack is before["torch_dlpack"]
        assert torch.utils.swap_tensors is before["swap"]
        assert torch.autograd.graph._engine_run_backward is before["run_backward"]
        assert torch.autograd._engine_run_backward is before["run_backward"]
        assert (list(optim_optimizer._foreach_supported_types),
                list(_foreach_utils._foreach_supported_types)) == foreach_types
        assert optim_optimizer._default_to_fused_or_foreach(
            list(m.parameters()), False) == (False, False)
        assert bcf.__dict__["apply"] is before["bcf_apply"]
        assert bcf.__dict__["apply_boxed"] is before["bcf_apply_boxed"]
        frame = torch.utils.checkpoint._CheckpointFrame
        assert frame.__dict__["get_inputs"] is before["ckpt_inputs"]
        assert torch.utils.checkpoint.detach_variable is before["ckpt_detach"]
        assert torch.amp.GradScaler.__dict__["_maybe_opt_step"] is before["scaler_step"]
        assert torch._C._autograd._saved_tensors_hooks_disable is before["hooks_off"]
        assert torch._C._autograd._saved_tensors_hooks_enable is before["hooks_on"]
        assert torch.nn.Module.__dict__["_apply"] is before["apply"]
        assert torch.__future__.get_swap_module_params_on_conversion is before["swap_flag"]
        assert torch.load is torch.serialization.load is before["torch_load"]
        assert torch._utils.set_tensor_metadata is before["set_metadata"]
        assert torch.accelerator.empty_cache is before["acc_empty_cache"]
        assert torch.accelerator.memory.memory_stats is before["acc_memory_stats"]
        assert torch.accelerator.synchronize is before["acc_synchronize"]
        assert torch._TorchCompileInductorWrapper.__call__ is before["inductor_call"]
        # _loading.uninstall() re-wraps the original function in a new staticmethod.
        assert cls.__dict__["_load_pretrained_model"].__func__ is before["load"].__func__
        assert cls.__dict__["from_pretrained"] is before["from_pretrained"]
        assert modeling_utils.safe_save_file is before["safe_save_file"]
        assert hub_torch.get_torch_storage_size is before["hub_size"]
        assert hub_torch.get_torch_storage_id is before["hub_id"]
        assert PartialState.__dict__["default_device"] is before["default_device"]
        assert Trainer.__dict__["_save_rng_state"] is before["save_rng"]
        assert Trainer.__dict__["_load_rng_state"] is before["load_rng"]
        PartialState._reset_state()
        # accelerate's own answer again: cpu before 1.16, unindexed tpu from 1.16 (which
        # asks torch.accelerator)
        assert PartialState().default_device in (torch.device("cpu"), torch.device("tpu"))
        assert accelerate_before == {
            "save_state": acc_accelerator.save_accelerator_state,
            "load_state": acc_accelerator.load_accelerator_state,
            "load_model": acc_checkpointing.load_model,
            "clean": acc_other.clean_state_dict_for_safetensors,
            "getitem": acc_offload.OffloadedWeightsLoader.__dict__["__getitem__"],
            "max_memory": hf_accelerate.accelerate_max_memory,
        }
        assert sys.meta_path == meta_path
        assert not hasattr(torch.backends, "tpu") and "torch.backends.tpu" not in sys.modules
        assert _backend() == CPU()
        assert trace_rules.SKIP_DIRS == skip_dirs
        assert dict(dynamo_registry._COMPILER_FNS) == dynamo_backends
        assert dict(ExpertsInterface._global_mapping) == experts
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_pin_memory", "CPU") == has_cpu_pin
        from torch.utils.data import dataloader
        assert dataloader._MultiProcessingDataLoaderIter.__init__ is before["dl_init"]
        assert not hasattr(torch.UntypedStorage, "tpu")
        assert OptimizerVariable.__dict__["_set_capturable"] is set_capturable
        assert "__new__" not in torch.UntypedStorage.__dict__
        assert not hasattr(torch.TypedStorage, "tpu")
        assert torch.nested.nested_tensor is before["nested_tensor"]
        assert torch.nested.as_nested_tensor is before["as_nested_tensor"]
        # torch's own refusal again ("Could not run 'aten::_to_copy' ...").
        assert not (nested_to_tpu_refusal() or "").startswith("torchjax")
        # The tpu loader stays (Note [Process-wide changes]): loading onto tpu still works.
        assert len(torch.serialization._package_registry) == len(loaders) + 1
        buf.seek(0)
        assert torch.load(buf, map_location="tpu")["w"].tolist() == [0.0, 1.0, 2.0]
        group = opt.param_groups[0]
        assert group["capturable"] is False
        assert all(opt.state[p]["step"].device.type == "cpu" for p in group["params"])
        assert all(opt.state[p]["step"].dtype == torch.float32 for p in group["params"])
        assert "_init_group" not in vars(opt)
        # CPU code and tpu tensors still work.
        assert torch.equal(torch.from_dlpack(dlpack.to_dlpack(torch.ones(2))), torch.ones(2))
        assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
    names = eval(out.split("names ", 1)[1].splitlines()[0])
    expected = {
        "torch.utils.dlpack.to_dlpack",
        "torch.to_dlpack",
        "torch.utils.swap_tensors",
        "torch.autograd.graph.saved_tensors_hooks.__enter__",
        "torch.autograd.function.BackwardCFunction.apply",
        "torch.autograd.graph._engine_run_backward",
        "torch.autograd._engine_run_backward",
        "torch.utils.checkpoint._CheckpointFrame.get_inputs",
        "torch.utils.checkpoint.detach_variable",
        "torch._C._autograd._saved_tensors_hooks_disable and _enable",
        "torch.amp.GradScaler._maybe_opt_step",
        "torch.nn.Module._apply",
        "torch.__future__.get_swap_module_params_on_conversion",
        "torch.load",
        "torch.UntypedStorage.__new__",
        "torch._utils.set_tensor_metadata",
        "torch.UntypedStorage.tpu",
        "torch.TypedStorage.tpu",
        "aten::_pin_memory CPU kernel",
        "NestedTensorPrivateUse1 fallback",
        "torch.nested.nested_tensor",
        "torch.nested.as_nested_tensor",
        "DataLoader worker start",
        "torch foreach tensor types",
        "torch.accelerator memory functions and synchronize",
        "Dynamo skip rules for torchjax",
        "FakeTensorMode.may_turn_const",
        "Dynamo OptimizerVariable._set_capturable",
        "torch._TorchCompileInductorWrapper.__call__",
        "optimizer capturable=True under jit",
        "transformers loading functions",
        "transformers ExpertsInterface entry",
        "accelerate PartialState.default_device",
        "transformers accelerate_max_memory",
        "accelerate clean_state_dict_for_safetensors",
        "accelerate.checkpointing.load_model",
        "accelerate OffloadedWeightsLoader.__getitem__",
        "accelerate save/load_accelerator_state",
        "transformers Trainer RNG state",
        "transformers GenerationMixin.generate",
        "torch.backends.tpu",
        "accelerate DynamoBackend._missing_",
        "safetensors.torch.load_file",
        "safetensors.torch.save_file",
        "torch._dynamo backend 'tpu'",
    }
    # transformers, accelerate and kernels were imported first: no import hook was needed.
    assert set(names) == expected, names


def test_import_hook_is_recorded_and_removed():
    out = _run(
        """
        import sys
        meta_path = list(sys.meta_path)
        import torchjax
        assert "sys.meta_path import hook" in [p.name for p in torchjax.patches()]
        assert sys.meta_path != meta_path
        torchjax.uninstall()
        assert sys.meta_path == meta_path
        from transformers import modeling_utils  # no longer patched on import
        assert not hasattr(modeling_utils.PreTrainedModel._load_pretrained_model,
                           "__torchjax_patch__")
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


@pytest.fixture(scope="module")
def hooks_on_import(request, tmp_path_factory) -> list:
    return once_per_run(request, tmp_path_factory, "hooks_on_import", _hooks_on_import)


def _hooks_on_import() -> list:
    # One child for the import hooks of kernels, then accelerate and transformers' Trainer
    # (importing torch and jax is most of a child's time): torchjax is imported first,
    # each library after it is patched on import, and uninstall undoes all of them.
    out = _run(
        """
        import sys
        import torch
        import torchjax
        assert "kernels" not in sys.modules and not hasattr(torch.backends, "tpu")
        names = [p.name for p in torchjax.patches()]
        assert "sys.meta_path import hook for kernels" in names
        assert "sys.meta_path import hook for accelerate.state" in names
        assert "sys.meta_path import hook for transformers.trainer" in names
        assert "sys.meta_path import hook for safetensors.torch" in names
        assert "sys.meta_path import hook for accelerate.utils.dataclasses" in names
        from kernels.backends import CPU, TPU, _backend
        assert "torch.backends.tpu" in [p.name for p in torchjax.patches()]
        assert _backend() == TPU()
        import torch.backends.tpu as tpu_backend
        assert tpu_backend.is_available() and tpu_backend.is_built()
        print("kernels patched", flush=True)
        from transformers import Trainer  # imports accelerate.state too
        from accelerate.state import PartialState
        names = [p.name for p in torchjax.patches()]
        assert "accelerate PartialState.default_device" in names
        assert "transformers Trainer RNG state" in names
        assert PartialState().device == torch.device("tpu", 0)
        assert Trainer._save_rng_state.__wrapped__ is not None
        from accelerate.utils.dataclasses import DynamoBackend
        import safetensors.torch as st
        names = [p.name for p in torchjax.patches()]
        assert "accelerate DynamoBackend._missing_" in names
        assert "safetensors.torch.load_file" in names
        assert DynamoBackend("TPU").value == "TPU"
        print("accelerate patched", flush=True)
        torchjax.uninstall()
        assert not hasattr(torch.backends, "tpu") and _backend() == CPU()
        print("kernels undone", flush=True)
        # transformers adds a finder of its own (its legacy module aliases).
        assert not [f for f in sys.meta_path if type(f).__module__.startswith("torchjax")]
        assert not hasattr(Trainer._save_rng_state, "__wrapped__")
        assert not hasattr(st.load_file, "__wrapped__")
        assert "_missing_" not in DynamoBackend.__dict__
        print("accelerate undone", flush=True)
        """
    )
    return out.strip().splitlines()


def test_accelerate_and_trainer_hooks_patch_on_import(hooks_on_import):
    assert "accelerate patched" in hooks_on_import
    assert "accelerate undone" in hooks_on_import


def test_kernels_hook_sets_torch_backends_tpu_on_import(hooks_on_import):
    assert "kernels patched" in hooks_on_import
    assert "kernels undone" in hooks_on_import


def test_kernels_hook_keeps_a_torch_backends_tpu_set_before():
    out = _run(
        """
        import types
        import torch
        own = torch.backends.tpu = types.ModuleType("torch.backends.tpu")
        import kernels
        import torchjax
        assert torch.backends.tpu is own
        assert "torch.backends.tpu" not in [p.name for p in torchjax.patches()]
        torchjax.uninstall()
        assert torch.backends.tpu is own
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_note_lists_every_recorded_patch():
    note = " ".join(_patches.__doc__.split())
    for p in torchjax.patches():
        assert f"``{p.name}``" in note, p.name
    hooks = [
        f"sys.meta_path import hook for {m}"
        for m in (
            "accelerate.state",
            "transformers.trainer",
            "transformers.generation.utils",
            "transformers.integrations.moe",
            "kernels",
        )
    ]
    for name in (
        "optimizer capturable=True under jit",
        "transformers ExpertsInterface entry",
        "jax persistent compilation cache",  # off in the suite (tests/conftest.py)
        "torch.nn.Module.__call__",  # in force only in fused eager mode
        "torch.optim global optimizer step hooks",  # likewise
        *hooks,
    ):
        assert f"``{name}``" in note


def test_untested_release_warns(monkeypatch):
    monkeypatch.setattr(_patches, "_INSTALLED", {})
    monkeypatch.setattr(_patches, "_WARNED", set())
    # The process's own flag stays down: once raised, fused mode's captured calls are
    # never made again in this process (a later test in it would capture nothing).
    monkeypatch.setattr(_patches, "_UNINSTALLED", [False])
    monkeypatch.setattr(_patches, "_version", lambda package: "9.1.0")
    undone = []
    with pytest.warns(
        torchjax.UntestedVersionWarning,
        match=re.escape("'a patch' was written for torch 2.13, but torch 9.1.0 is installed"),
    ):
        _patches.record(
            "a patch",
            why="test",
            package="torch",
            written_for="2.13",
            undo=lambda: undone.append(1),
        )
    assert [p.name for p in _patches.installed()] == ["a patch"]
    _patches.uninstall()
    assert undone == [1] and _patches.installed() == []


def test_tested_release_is_silent(recwarn):
    assert _patches._same_release("2.13.0+cpu", "2.13")
    assert _patches._same_release("5.24.1", "5.24")
    assert not _patches._same_release("2.130.0", "2.13")
    assert not _patches._same_release("5.3.0", "5.24")
    _patches.check_version("x", "torch", _patches._version("torch").split("+")[0])
    assert not [w for w in recwarn if w.category is torchjax.UntestedVersionWarning]


def test_replace_attr_restores_class_dict_entry():
    class Owner:
        @staticmethod
        def f():
            return 1

    raw = Owner.__dict__["f"]
    original = _patches.replace_attr(
        Owner, "f", staticmethod(lambda: 2), name="t", why="", package=None, written_for=None
    )
    assert original is raw and Owner.f() == 2
    _patches._INSTALLED.pop("t").undo()
    assert Owner.__dict__["f"] is raw


def test_the_ragged_dot_experts_name_works_without_registering():
    out = _run(
        """
        import torchjax, transformers
        from transformers.integrations.moe import ExpertsInterface
        assert "torchjax_ragged_dot" in ExpertsInterface._global_mapping
        torchjax.uninstall()
        assert "torchjax_ragged_dot" not in ExpertsInterface._global_mapping
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
