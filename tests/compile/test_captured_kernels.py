"""Captured module calls (Note [Captured module calls] in torchjax/compile/_captured.py)
with the attention a TPU chooses, forced on CPU: the flash and decode kernels (Pallas,
in interpret mode) and SDPA's exact math (Note [SDPA math by platform]) are kernel ops,
which fused mode records and a captured call traces as nodes (Note [A kernel op is an
eager op] in torchjax/pallas/_op.py): with eager's bits."""

import contextlib
import functools

import pytest
import torch
import transformers as tf

import torchjax
from tests._models import KERNEL_IDS, tiny_llama
from tests.compile._capture_stats import capture_counts
from torchjax import pallas as tp
from torchjax.ops import executables
from torchjax.pallas import _decode_sdpa, _sdpa, _sdpa_math

TPU = "tpu"


pytestmark = pytest.mark.usefixtures("fresh_executables")


@contextlib.contextmanager
def _tpu_attention():
    # What jax's TPU backend selects by itself: the kernels on (``flash_enabled``'s
    # auto), the exact op as SDPA's math fallback (``MATH_BY_PLATFORM["tpu"]``).
    with tp.use_flash_attention(True), tp.use_math_attention("exact"):
        yield


def _traced(monkeypatch, module, name) -> list:
    """Records each trace of the jax function ``module.name`` (a kernel op's body)."""
    seen, fn = [], getattr(module, name)

    @functools.wraps(fn)
    def spy(*args, **kwargs):
        seen.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


_KERNELS = {"flash": (_sdpa, "_flash_attention"), "exact": (_sdpa_math, "exact_attention")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["flash", "exact"])
def test_llama_forward_with_tpu_attention_is_captured_with_eagers_bits(monkeypatch, kernel, dtype):
    traced = _traced(monkeypatch, *_KERNELS[kernel])
    model = tiny_llama(hidden_size=64).to(TPU).to(dtype)
    # 8 tokens: the flash kernel refuses them, the exact op takes them.
    ids = (KERNEL_IDS if kernel == "flash" else KERNEL_IDS[:, :8]).to(TPU)
    with _tpu_attention(), torch.no_grad():
        eager = model(ids).logits.cpu()
        assert traced  # SDPA took the kernel op
        torchjax.reset_stats()
        with torchjax.fused(capture=False):
            recorded = model(ids).logits.cpu()
        segments = torchjax.stats()["fused_segments"]
        torchjax.reset_stats()
        with torchjax.fused():
            captured = [model(ids).logits.cpu() for _ in range(3)]
    for out in [recorded, *captured]:
        assert torch.equal(out, eager)
    # First call op by op, second traced and run, third the program alone.
    assert capture_counts() == (2, 1, 0)
    # The kernel op is recorded: it ends no segment (it ended one per layer).
    assert segments == 1


def _train_steps(model, loss_of, capture, steps=3):
    """``steps`` AdamW steps of ``model`` on the loss ``loss_of(model)`` in fused eager
    (capture on or off): per step the loss, every gradient and the parameters after it;
    and the capture counts."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    out = []
    torchjax.reset_stats()
    for _ in range(steps):
        with torchjax.fused(capture=capture):
            loss = loss_of(model)
            loss.backward()
            grads = [p.grad.cpu() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        out.append((loss.detach().cpu(), grads, [p.detach().cpu() for p in model.parameters()]))
    return out, capture_counts()


def _assert_equal_steps(got, want):
    assert len(got) == len(want) > 0
    for (loss, grads, params), (wloss, wgrads, wparams) in zip(got, want, strict=True):
        assert torch.equal(loss, wloss)
        assert len(grads) == len(wgrads) > 0
        for g, w in zip(grads + params, wgrads + wparams, strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["flash", "exact"])
def test_llama_train_steps_with_tpu_attention_are_captured_with_fused_bits(
    monkeypatch, kernel, dtype
):
    # Note [Kernel op backward]: the kernel op's backward is an eager op, traced as a
    # node of the captured backward (it ran inline, and every such step was refused).
    traced = _traced(monkeypatch, *_KERNELS[kernel])
    ids = (KERNEL_IDS if kernel == "flash" else KERNEL_IDS[:, :8]).to(TPU)
    runs = []
    with _tpu_attention():
        for capture in (False, True):
            model = tiny_llama(hidden_size=64).to(TPU).to(dtype).train()
            runs.append(_train_steps(model, lambda m: m(ids, labels=ids).loss, capture))
    assert traced  # SDPA took the kernel op
    (want, _), (got, counts) = runs
    _assert_equal_steps(got, want)
    # Step 1 op by op, step 2 traced and run, step 3 the programs alone; none refused.
    assert counts == (2, 1, 0)
    assert torchjax.stats()["capture_refusal_reasons"] == {}


class _Experts(torch.nn.Module):
    """Two experts' weights through the ragged dot kernel (a MoE layer's shape)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(2, 16, 16) * 0.1)
        self.register_buffer("sizes", torch.tensor([8, 8]))

    def forward(self, x):
        return tp.ragged_dot(x, self.w, self.sizes).tanh()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_dot_train_steps_are_captured_with_fused_bits(dtype):
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(TPU).to(dtype)
    (want, _), (got, counts) = [
        _train_steps(_Experts().to(TPU).to(dtype), lambda m: m(x).pow(2).mean(), capture)
        for capture in (False, True)
    ]
    _assert_equal_steps(got, want)
    assert counts == (2, 1, 0)


def test_static_cache_decode_steps_with_the_decode_kernel_are_captured(monkeypatch):
    traced = _traced(monkeypatch, _decode_sdpa, "_decode_attention")
    model = tiny_llama(hidden_size=64).to(TPU)

    def decode():
        # 48 positions, a multiple of 16: the decode kernel takes every step.
        cache = tf.StaticCache(config=model.config, max_cache_len=48)
        logits = []
        with _tpu_attention(), torch.no_grad():
            out = model(KERNEL_IDS.to(TPU), cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for step in range(5):
                pos = torch.tensor([KERNEL_IDS.shape[1] + step]).to(TPU)
                out = model(token, cache=cache, cache_position=pos, use_cache=True)
                logits.append(out.logits.cpu())
                token = out.logits[:, -1:].argmax(-1)
        return logits + [layer.keys.cpu() for layer in cache.layers]

    eager = decode()
    assert traced
    executables.clear_caches()
    torchjax.reset_stats()
    with torchjax.fused():
        fused = decode()
    for got, want in zip(fused, eager, strict=True):
        assert torch.equal(got, want)
    assert capture_counts() == (4, 1, 0)  # decode steps 2-5


def test_eager_generate_decode_steps_with_the_decode_kernel_are_captured(monkeypatch):
    # Eager generate's automatic static cache is sized for the kernels (Note [A static
    # cache for eager generate on tpu]): 48 positions for a 32-token prompt and 16 new.
    traced = _traced(monkeypatch, _decode_sdpa, "_decode_attention")
    model = tiny_llama(hidden_size=64).to(TPU)
    kwargs = dict(max_new_tokens=16, do_sample=False, disable_compile=True)
    with _tpu_attention(), torch.no_grad():
        eager = model.generate(KERNEL_IDS.to(TPU), **kwargs).cpu()
        assert traced
        executables.clear_caches()
        del traced[:]
        torchjax.reset_stats()
        with torchjax.fused():
            fused = model.generate(KERNEL_IDS.to(TPU), **kwargs).cpu()
    assert traced  # the fused decode steps took the kernel too
    assert eager.shape == (1, 48) and torch.equal(fused, eager)
    # 15 decode steps: the first recorded op by op, the second traced and run, the rest
    # the program alone.
    assert capture_counts() == (14, 1, 0)
