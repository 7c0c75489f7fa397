"""Note [Masks known at trace time] (torchjax/ops/attention.py): inside a trace, an SDPA
mask that the program computes from constants alone is evaluated while tracing; an
exactly causal one becomes ``is_causal=True`` and one that masks nothing becomes None.
Masks that read the program's arguments stay masks. Values equal CPU torch's."""

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import torchjax
from examples import tiny_llama_generate as tl
from torchjax.pallas import _sdpa
from torchjax.tensor._fake import is_fake


@pytest.fixture
def kernel_calls(monkeypatch):
    """(mask is None, is_causal) as the kernel choice sees them (once or twice per
    SDPA call: the Autograd kernel may hand the call on to the dispatch-level one)."""
    calls = []
    original = _sdpa.causal_into_mask

    def spy(q, k, v, attn_mask, dropout_p, is_causal, **kwargs):
        if not is_fake(q):
            calls.append((attn_mask is None, is_causal))
        return original(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(_sdpa, "causal_into_mask", spy)
    return calls


def _qkv(seed=0, length=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length, 4, generator=g) for _ in range(3)]


_TRIL = torch.ones(8, 8, dtype=torch.bool).tril()
# Each mask is made inside the traced function from constants, as models make them.
MASKS = {
    "bool tril": (lambda: torch.ones(8, 8, dtype=torch.bool, device="tpu").tril(), (True, True)),
    "bool from positions (B, 1, L, S)": (
        lambda: (
            torch.arange(8, device="tpu")[None, :] <= torch.arange(8, device="tpu")[:, None]
        ).expand(2, 1, 8, 8),
        (True, True),
    ),
    "float 0 / -inf": (
        lambda: torch.zeros(8, 8, device="tpu").masked_fill(
            ~torch.ones(8, 8, dtype=torch.bool, device="tpu").tril(), float("-inf")
        ),
        (True, True),
    ),
    "bfloat16 0 / -inf": (
        lambda: torch.zeros(8, 8, dtype=torch.bfloat16, device="tpu").masked_fill(
            ~torch.ones(8, 8, dtype=torch.bool, device="tpu").tril(), float("-inf")
        ),
        (True, True),
    ),
    "all True": (lambda: torch.ones(1, 8, dtype=torch.bool, device="tpu"), (True, False)),
    "sliding window (not causal)": (
        lambda: (
            torch.ones(8, 8, dtype=torch.bool, device="tpu").tril()
            & ~torch.ones(8, 8, dtype=torch.bool, device="tpu").tril(-3)
        ),
        (False, False),
    ),
    "float with a finite bias (not causal)": (
        lambda: torch.ones(8, 8, dtype=torch.bool, device="tpu").tril().float() - 1.0,
        (False, False),
    ),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_a_constant_mask_under_jit(name, kernel_calls):
    make, expected = MASKS[name]
    mask = make().cpu()
    # A float mask takes the query's dtype.
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    q, k, v = (t.to(dtype) for t in _qkv())

    @torchjax.jit
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make())

    out = attend(*(t.to("tpu") for t in (q, k, v)))
    assert set(kernel_calls) == {expected}
    # bfloat16: a few ulps of summation order (eager tpu's masked path is within 8e-3).
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, mask), **tol)


def test_a_mask_from_an_argument_stays_a_mask(kernel_calls):
    q, k, v = _qkv()

    @torchjax.jit
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    # The argument is a causal mask: not known while tracing, so not replaced.
    out = attend(*(t.to("tpu") for t in (q, k, v, _TRIL)))
    assert set(kernel_calls) == {(False, False)}
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, _TRIL))
    # A later call with another mask runs the same program on it.
    window = _TRIL & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    out = attend(*(t.to("tpu") for t in (q, k, v, window)))
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, window))


def test_a_constant_mask_combined_with_an_argument_stays_a_mask(kernel_calls):
    q, k, v = _qkv()
    padding = torch.tensor([[True] * 8, [False] * 2 + [True] * 6])

    @torchjax.jit
    def attend(q, k, v, padding):
        causal = torch.ones(8, 8, dtype=torch.bool, device="tpu").tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & padding[:, None, None])

    out = attend(*(t.to("tpu") for t in (q, k, v, padding)))
    assert set(kernel_calls) == {(False, False)}
    mask = _TRIL & padding[:, None, None]
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, mask))


def test_eager_masks_are_not_read(kernel_calls):
    q, k, v = _qkv()
    out = F.scaled_dot_product_attention(*(t.to("tpu") for t in (q, k, v, _TRIL)))
    assert set(kernel_calls) == {(False, False)}
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, _TRIL))


def test_a_torch_compiled_llama_train_step_calls_sdpa_causal(kernel_calls):
    # Under Dynamo transformers materialises the causal mask (it cannot read the position
    # ids); the kernels get is_causal, and loss and gradients equal CPU's.
    cfg = tl.tiny_llama_config()
    torch.manual_seed(0)
    cpu = tf.LlamaForCausalLM(cfg)
    model = tf.LlamaForCausalLM(cfg)
    model.load_state_dict(cpu.state_dict())
    model.to("tpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(m, ids):
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    got = torch.compile(step, backend="tpu")(model, ids.to("tpu"))
    want = step(cpu, ids)
    assert len(kernel_calls) >= cfg.num_hidden_layers
    assert set(kernel_calls) == {(True, True)}
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_checkpointed_llama_under_torch_compile_with_the_flash_kernel(kernel_calls):
    # The recomputation of a checkpointed layer runs in the backward's trace, where the
    # mask's value is unknown: it replays the forward's choice, so both take the causal
    # kernel (a different one saved other tensors, which torch's checkpoint refused). The
    # flash kernel runs in Pallas's interpret mode off the chip.
    cfg = tf.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu = tf.LlamaForCausalLM(cfg)
    model = tf.LlamaForCausalLM(cfg)
    model.load_state_dict(cpu.state_dict())
    model.to("tpu")
    for m in (cpu, model):
        m.activation_checkpointing_enable()  # non-reentrant torch.utils.checkpoint
        m.train()
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1))

    def step(m, ids):
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    with torchjax.pallas.use_flash_attention(True):
        got = torch.compile(step, backend="tpu")(model, ids.to("tpu"))
    want = step(cpu, ids)
    # One layer: its forward and its recomputation, each calling SDPA causally.
    assert len(kernel_calls) >= 2 and set(kernel_calls) == {(True, True)}
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5, msg=name)
