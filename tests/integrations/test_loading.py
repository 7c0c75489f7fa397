"""torchjax/integrations/transformers/_loading.py: from_pretrained(device_map="tpu") reads
safetensors through torchjax.checkpoint (no CPU torch copy), save_pretrained works on tpu
models, tied weights stay tied, bf16 stays bf16; logits equal CPU."""

import copy
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a test dependency: never skipped)
from safetensors import safe_open  # noqa: E402
from transformers import modeling_utils  # noqa: E402

import torchjax  # noqa: E402,F401
from torchjax.checkpoint import _reader  # noqa: E402
from torchjax.integrations.transformers import _loading  # noqa: E402

IDS = torch.tensor([[1, 17, 42, 99, 5, 6]])


def _config(dtype=torch.float32):
    from examples.tiny_llama_generate import tiny_llama_config

    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    cfg.dtype = dtype
    return cfg


@pytest.fixture(scope="module")
def cpu_model_and_dir(tmp_path_factory):
    """A tiny tied Llama saved as an HF *sharded* checkpoint (index json + 3 files)."""
    path = str(tmp_path_factory.mktemp("tiny_tied_llama"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config()).eval()
    model.save_pretrained(path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return model, path


@pytest.fixture
def reads(monkeypatch):
    """Counts torchjax.checkpoint reads; transformers' own safe_open must not be used."""
    count = []
    read = _reader.SafetensorsFile.read
    monkeypatch.setattr(
        _reader.SafetensorsFile, "read", lambda self, *a: count.append(a[0]) or read(self, *a)
    )
    return count


def _logits(model, device):
    with torch.no_grad():
        return model(IDS.to(device)).logits.to("cpu")


def test_patches_target_this_transformers(cpu_model_and_dir):
    # Note [Patching transformers' loading and saving]: an upgrade that moves the patched
    # functions or changes their signatures fails here, not somewhere in a model load.
    assert transformers.__version__.startswith(_loading.PATCHED_FOR)
    load = modeling_utils.PreTrainedModel._load_pretrained_model
    save = modeling_utils.safe_save_file
    assert hasattr(load, "__torchjax_patch__") and hasattr(save, "__torchjax_patch__")
    params = list(inspect.signature(load.__torchjax_patch__).parameters)
    assert params[:4] == ["model", "state_dict", "checkpoint_files", "load_config"]
    assert list(inspect.signature(save).parameters) == ["tensors", "filename", "metadata"]
    from_pretrained = modeling_utils.PreTrainedModel.from_pretrained
    assert hasattr(from_pretrained, "__torchjax_patch__")
    source = inspect.getsource(from_pretrained.__torchjax_patch__.__func__)
    assert "cls._load_pretrained_model(" in source
    # The tensor-parallel arguments the from_pretrained hook routes to torchjax.sharding.
    for kwarg in ("distributed_config", "tp_plan", "tp_size"):
        assert f'kwargs.pop("{kwarg}"' in source, kwarg
    source = inspect.getsource(modeling_utils.PreTrainedModel.save_pretrained)
    assert "safe_save_file(shard_state_dict, filename, metadata=metadata)" in source


def test_fast_path_reads_every_tensor_and_matches_cpu(cpu_model_and_dir, reads, monkeypatch):
    cpu, path = cpu_model_and_dir

    def no_torch_reader(*args, **kwargs):
        raise AssertionError("transformers' safe_open was used instead of torchjax.checkpoint")

    monkeypatch.setattr(modeling_utils, "safe_open", no_torch_reader)
    tpu = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    n_saved = sum(
        len(safe_open(os.path.join(path, f), "np").keys())
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    assert len(reads) == n_saved == len(cpu.state_dict()) - 1  # lm_head is tied, not saved
    assert all(p.device.type == "tpu" and p.dtype == torch.float32 for p in tpu.parameters())
    assert tpu.lm_head.weight is tpu.model.embed_tokens.weight
    torch.testing.assert_close(_logits(tpu, "tpu"), _logits(cpu, "cpu"), rtol=1e-4, atol=1e-4)

    # save_pretrained from tpu, then from_pretrained on tpu again: tied weights stored once
    # and tied after loading, logits still those of CPU.
    monkeypatch.undo()
    saved = os.path.join(path, "from_tpu")
    tpu.save_pretrained(saved)
    with safe_open(os.path.join(saved, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), cpu.lm_head.weight)
    again = transformers.AutoModelForCausalLM.from_pretrained(saved, device_map="tpu")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    torch.testing.assert_close(_logits(again, "tpu"), _logits(cpu, "cpu"), rtol=1e-4, atol=1e-4)


def test_loaded_weights_share_programs_with_tensors_made_on_tpu(cpu_model_and_dir):
    # Note [Uncommitted arrays on tpu:0]: weights the fast path read were committed to
    # their device, so every program taking a weight and a tensor made on tpu compiled
    # again beside the one for tensors made on tpu alone.
    tpu = transformers.AutoModelForCausalLM.from_pretrained(cpu_model_and_dir[1], device_map="tpu")
    w = tpu.model.norm.weight.detach()
    made = torch.ones(w.shape, device="tpu")
    torch.atan2(made, made).cpu()
    before = torchjax.stats()["compiles"]
    got = torch.atan2(w, made)
    assert torchjax.stats()["compiles"] == before
    torch.testing.assert_close(got.cpu(), torch.atan2(w.cpu(), made.cpu()))


def test_cpu_device_map_and_uninstall_keep_transformers_loader(cpu_model_and_dir, reads):
    cpu, path = cpu_model_and_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    assert reads == [] and model.lm_head.weight.device.type == "cpu"
    _loading.uninstall()  # transformers' own loader: a CPU copy per tensor, then .to("tpu")
    try:
        assert not hasattr(
            modeling_utils.PreTrainedModel._load_pretrained_model, "__torchjax_patch__"
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    finally:
        _loading.install()
    assert reads == [] and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight.cpu(), cpu.lm_head.weight)


def test_bf16_stays_bf16_and_dtype_casts_like_torch(cpu_model_and_dir, tmp_path, reads):
    cpu, path = cpu_model_and_dir
    torch.manual_seed(1)
    cpu16 = transformers.AutoModelForCausalLM.from_config(_config()).to(torch.bfloat16)
    cpu16.save_pretrained(tmp_path)
    tpu16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert reads
    for (name, p), q in zip(tpu16.named_parameters(), cpu16.parameters()):
        # bit-exact bf16: no round trip through float32
        assert p.dtype == torch.bfloat16 and torch.equal(p.cpu(), q), name
    # dtype=bfloat16 from the float32 checkpoint: cast on the device, rounded as torch does.
    cast = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map="tpu", dtype=torch.bfloat16
    )
    for (name, p), q in zip(cast.named_parameters(), cpu.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.cpu(), q.bfloat16()), name


def test_tpu_state_dict_to_cpu_keeps_sharing():
    # What save_pretrained's tied-weight detection needs: tpu tensors sharing a storage
    # become CPU tensors sharing one (views stay views), with the same values.
    base = torch.arange(12.0).reshape(3, 4).to("tpu")
    other = torch.ones(2, device="tpu")
    out = _loading.tpu_state_dict_to_cpu({"a": base, "tied": base, "row": base[1], "o": other})
    assert out["a"].data_ptr() == out["tied"].data_ptr()
    assert out["row"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert out["o"].untyped_storage().data_ptr() != out["a"].untyped_storage().data_ptr()
    assert torch.equal(out["row"], base.cpu()[1]) and torch.equal(out["o"], torch.ones(2))


def test_tensor_parallel_arguments_route_to_torchjax_sharding():
    # The load itself is tested on 8 simulated devices (tests/sharding/_cases.py, Qwen3).
    from transformers.distributed import DistributedConfig

    from torchjax.sharding import TensorParallelConfig

    kwargs = {"device_map": "tpu", "tp_plan": "auto", "tp_size": 4, "dtype": torch.bfloat16}
    tp = _loading.tensor_parallel_config(kwargs)
    assert (tp.plan, tp.tp_size) == ("auto", 4) and kwargs == {"dtype": torch.bfloat16}
    kwargs = {"device_map": "tpu:0", "distributed_config": DistributedConfig(tp_plan="auto")}
    assert _loading.tensor_parallel_config(kwargs).plan == "auto" and kwargs == {}
    mine = TensorParallelConfig(plan={"model.layers.*.mlp.up_proj": "colwise"})
    kwargs = {"distributed_config": mine}
    assert _loading.tensor_parallel_config(kwargs) is mine and kwargs == {}
    for untouched in ({"device_map": "cpu", "tp_plan": "auto"}, {"device_map": "tpu"}, {}):
        before = dict(untouched)
        assert _loading.tensor_parallel_config(untouched) is None and untouched == before


def _call_forms(mode: str, root) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.integrations._hf_call_forms", mode, str(root)],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_import_torchjax_keeps_transformers_call_forms_and_signatures(tmp_path):
    # import torchjax must not change any public signature or CPU result of transformers:
    # from_pretrained / save_pretrained positional and keyword forms, each Auto class and
    # AutoConfig, run in one process without torchjax and one with it.
    plain = _call_forms("plain", tmp_path / "plain")
    patched = _call_forms("torchjax", tmp_path / "torchjax")
    assert plain.keys() == patched.keys()
    for key in plain:
        assert plain[key] == patched[key], key
    # In this process too (torchjax imported since the top of the file).
    functions = {
        "from_pretrained": modeling_utils.PreTrainedModel.from_pretrained,
        "_load_pretrained_model": modeling_utils.PreTrainedModel._load_pretrained_model,
        "safe_save_file": modeling_utils.safe_save_file,
    }
    for name, f in functions.items():
        assert hasattr(f, "__torchjax_patch__"), name
        assert [str(inspect.signature(f)), f.__name__, f.__doc__] == plain["signatures"][name]


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_save_pretrained_from_tpu_writes_cpus_files(cpu_model_and_dir, tmp_path, max_shard_size):
    # The shard files and index of a tpu model are byte for byte those of the same model
    # on CPU (tied lm_head left out, written one tensor at a time).
    cpu, _ = cpu_model_and_dir
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    cpu.save_pretrained(tmp_path / "cpu", **kwargs)
    copy.deepcopy(cpu).to("tpu").save_pretrained(tmp_path / "tpu", **kwargs)
    names = sorted(os.listdir(tmp_path / "cpu"))
    assert names == sorted(os.listdir(tmp_path / "tpu"))
    assert len([n for n in names if n.endswith(".safetensors")]) > (max_shard_size is not None)
    for name in names:
        if name.endswith((".safetensors", ".json")) and name != "config.json":
            assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "tpu" / name).read_bytes()
