"""The Hugging Face ``kernels`` library on "tpu": with torchjax imported it selects its
TPU backend, ``get_local_kernel`` loads a repository's ``torch-tpu`` build variant
(examples/hub_kernel, functions written with ``torchjax.pallas.op``), ``kernelize(model,
device="tpu")`` swaps hub layers in eager, under ``torchjax.jit`` and under
``torch.compile(backend="tpu")``, and its experts forward serves as transformers'
``experts_implementation``: each = CPU, and each check sees the kernel run."""

from pathlib import Path

import kernels
import pytest
import torch
import transformers as tf
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)
from kernels.backends import TPU, _backend
from kernels.variants import parse_variant, resolve_variant
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import examples
import torchjax
from tests._models import tiny_llama
from tests.integrations import tiny_models

# One absolute path: kernels caches a loaded variant by its path, and a second import of
# the repository would define its torch ops twice.
REPO = Path(examples.__file__).resolve().parent / "hub_kernel"
EXPERTS = "tpu_layers_experts"


@pytest.fixture(scope="module")
def kernel():
    return kernels.get_local_kernel(REPO)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_kernels_selects_the_tpu_backend_and_variant():
    assert torch.backends.tpu.is_available() and torch.backends.tpu.is_built()
    assert _backend() == TPU()
    variants = [parse_variant(v) for v in ("torch-cpu", "torch-tpu", "torch-cuda")]
    assert resolve_variant(variants)[0].variant_str == "torch-tpu"


def test_variant_selection_follows_the_backend(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"torch-tpu: backend \(tpu\) does not match"):
        kernels.get_local_kernel(REPO, backend="cpu")
    # A repository with only compiled CUDA builds has nothing for tpu.
    (tmp_path / "build" / "torch213-cxx11-cu128-x86_64-linux").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="Cannot find a build variant"):
        kernels.get_local_kernel(tmp_path)


def test_get_local_kernel_loads_the_tpu_variant(kernel):
    assert Path(kernel.__file__).parent.parent.name == "torch-tpu"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, 16, generator=g), torch.randn(16, generator=g)
    norm = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
    xt = x.to("tpu").requires_grad_()
    wt = w.to("tpu").requires_grad_()
    out = kernel.rms_norm(xt, wt, 1e-5)
    out.pow(2).sum().backward()
    xc = x.clone().requires_grad_()
    expected = norm(xc)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    torch.testing.assert_close(wt.grad.cpu(), norm.weight.grad)

    y = torch.randn(4, 2, 12, generator=g, dtype=torch.bfloat16)
    expected = torch.nn.functional.silu(y[..., :6]) * y[..., 6:]
    got = kernel.silu_and_mul(y.to("tpu")).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


@pytest.fixture
def hub_rmsnorm():
    # transformers 5.24 decorates LlamaRMSNorm with use_kernel_forward_from_hub only for
    # kernels >= 0.18.2, so with kernels 0.17 the layer is made extensible the way
    # kernels documents for third-party layers; the class attributes are removed after.
    replace_kernel_forward_from_hub(LlamaRMSNorm, "RMSNorm")
    yield
    del LlamaRMSNorm.kernel_layer_name, LlamaRMSNorm.kernel_condition


def _kernelize(model, mode):
    mapping = {"RMSNorm": {"tpu": LocalLayerRepository(repo_path=REPO, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        return kernelize(model, device="tpu", mode=mode, use_fallback=False)


def _logits(model):
    return lambda x: model(input_ids=x).logits


@pytest.fixture
def no_jax_cache_clears():
    """Trace counts are what these tests measure. A turnover of the executable cache
    budget (Note [Executable cache budget] in torchjax/_budget.py), brought on by
    whatever ran before in this process, clears jax's staging caches, and the kernel's
    jax function is then traced again mid-call; so no clears while they count."""
    from torchjax import _budget

    old = _budget.BUDGET.clear_jax
    torchjax.set_cache_budget(clear_jax_caches=False)
    yield
    torchjax.set_cache_budget(clear_jax_caches=old)


def test_kernelize_swaps_llama_rmsnorm_in_eager_jit_and_compile(
    kernel, hub_rmsnorm, no_jax_cache_clears
):
    model = tiny_llama()  # SDPA attention, transformers' default
    g = torch.Generator().manual_seed(0)
    ids = {n: torch.randint(3, 128, (1, n), generator=g) for n in (6, 7, 8)}
    with torch.no_grad():
        expected = {n: model(input_ids=x).logits for n, x in ids.items()}
    model.to("tpu")
    _kernelize(model, Mode.INFERENCE | Mode.TORCH_COMPILE)
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 5  # 2 layers x 2 + the final norm
    assert all(m.forward.__func__ is kernel.layers.RMSNorm.forward for m in norms)

    # CALLS counts traces of the kernel's jax function: one per new input shape (its
    # jax.jit cache then serves the other norms), so each mode gets a length of its own.
    def run(fn, n):
        before = kernel.CALLS["rms_norm"]
        with torch.no_grad():
            logits = fn(ids[n].to("tpu"))
        torch.testing.assert_close(logits.cpu(), expected[n], rtol=1e-4, atol=1e-4)
        return kernel.CALLS["rms_norm"] - before

    assert run(_logits(model), 8) == 1  # eager
    assert run(torchjax.jit(_logits(model)), 7) == 1
    # torch.compile: the graph Dynamo hands the tpu backend calls the kernel's op (the
    # fake implementation also traces the jax function, so CALLS would not tell).
    from torchjax.compile._dynamo import backend as dynamo_backend

    graphs = []

    def tpu_backend(gm, example_inputs):
        graphs.append(gm)
        return dynamo_backend(gm, example_inputs)

    run(torch.compile(_logits(model), backend=tpu_backend), 6)
    assert len(graphs) == 1  # no graph break at the kernel
    kernel_op = torch.ops.tpu_layers.rms_norm
    calls = [n for n in graphs[0].graph.nodes if n.target in (kernel_op, kernel_op.default)]
    assert len(calls) == len(norms)


@use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def test_kernelize_silu_and_mul_for_training_matches_cpu_gradients(kernel):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), SiluAndMul(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    mlp(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    mlp.to("tpu")
    mapping = {"SiluAndMul": {"tpu": LocalLayerRepository(repo_path=REPO, layer_name="SiluAndMul")}}
    with use_kernel_mapping(mapping):
        kernelize(mlp, mode=Mode.TRAINING, use_fallback=False)  # device read from the params
    assert mlp[1].forward.__func__ is kernel.layers.SiluAndMul.forward
    before = kernel.CALLS["silu_and_mul"]
    mlp(x.to("tpu")).pow(2).sum().backward()
    assert kernel.CALLS["silu_and_mul"] > before
    for p, g in zip(mlp.parameters(), expected):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-5)


@pytest.fixture
def registered_experts(kernel):
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, kernel.experts_forward)
    yield
    ExpertsInterface._global_mapping.pop(EXPERTS)


def test_experts_forward_as_transformers_experts_implementation(
    kernel, registered_experts, tmp_path, no_jax_cache_clears
):
    tiny_models.save_tiny("qwen3_moe", str(tmp_path))
    ids = torch.tensor([[1, 5, 9, 17, 33, 60, 7, 3]])
    cpu = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        expected = cpu(input_ids=ids).logits
    model = tf.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), device_map="tpu", experts_implementation=EXPERTS
    ).eval()
    assert model.config._experts_implementation == EXPERTS
    before = kernel.CALLS["experts"]
    with torch.no_grad():
        logits = torchjax.jit(lambda x: model(input_ids=x).logits)(ids.to("tpu"))
    assert kernel.CALLS["experts"] - before == 1  # traced once, both layers share shapes
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_a_find_spec_before_the_import_keeps_the_hook():
    # diffusers asks importlib.util.find_spec("kernels") before importing it; the hook
    # used to remove itself then, and torch.backends.tpu was never set.
    import subprocess
    import sys

    code = (
        "import importlib.util, torch, torchjax\n"
        "assert importlib.util.find_spec('kernels') is not None\n"
        "import kernels\n"
        "assert torch.backends.tpu.is_built()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
