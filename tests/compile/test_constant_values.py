"""Note [Values made from constants inside a trace] (torchjax/ops/executables.py): under
``torchjax.jit`` an op whose arguments are all concrete gives a concrete value, so code
that reads values when they are known (transformers' mask shortcuts) does so as in eager;
values from the program's inputs, and large values, stay computations of the program."""

import jax
import pytest
import torch
import transformers as tf

import torchjax
from examples import tiny_llama_generate as tl


def _is_tracer(t: torch.Tensor) -> bool:
    return isinstance(t.jax(), jax.core.Tracer)


def test_values_from_constants_are_concrete_and_values_from_inputs_are_traced():
    seen = {}

    @torchjax.jit
    def f(x):
        pos = torch.arange(8, device="tpu")
        packed = (torch.diff(pos, prepend=pos[:1] - 1) != 1).cumsum(-1)
        seen["packed"] = _is_tracer(packed)
        # A shortcut that reads a value: possible only when the value is known.
        shortcut = bool((packed == 0).all())
        seen["shortcut"] = shortcut
        y = x + pos
        seen["y"] = _is_tracer(y)
        big = torch.arange(1 << 17, device="tpu").cumsum(0)
        seen["big"] = _is_tracer(big)
        return y * 2, big[-1]

    x = torch.arange(8.0)
    y, last = f(x.to("tpu"))
    assert seen == {"packed": False, "shortcut": True, "y": True, "big": True}
    torch.testing.assert_close(y.cpu(), (x + torch.arange(8)) * 2)
    assert last.item() == torch.arange(1 << 17).cumsum(0)[-1].item()
    # The second call runs the cached program with the same values.
    y2, _ = f((x + 1).to("tpu"))
    torch.testing.assert_close(y2.cpu(), (x + 1 + torch.arange(8)) * 2)


def test_a_compiled_llama_forward_calls_sdpa_as_eager_does(monkeypatch):
    # transformers checks the model's own position ids for packed sequences; when it can
    # read them it calls SDPA with is_causal and the key/value heads unrepeated. Traced
    # ids made it pass a (B, 1, S, S) mask and repeat the heads to the query's.
    cfg = tl.tiny_llama_config()
    torch.manual_seed(0)
    cpu = tf.LlamaForCausalLM(cfg).eval()
    model = tf.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(cpu.state_dict())
    model.to("tpu")
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal, kw.get("enable_gqa", False), k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 128, (2, 16))
    fwd = torchjax.jit(lambda ids: model(ids, use_cache=False).logits)
    out = fwd(ids.to("tpu"))
    assert calls == [(True, True, True, 2)] * 2, calls
    with torch.no_grad():
        want = cpu(ids, use_cache=False).logits
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=1e-4)


class _Slots:
    __slots__ = ("t",)


def test_a_concrete_write_into_a_tensor_outside_the_state_is_refused():
    # Evaluated when traced, such a write would happen once and never when the program
    # runs: refused as a traced write is (Note [Writes that escape a trace]).
    hidden = _Slots()
    hidden.t = torch.zeros(2, device="tpu")

    def from_constants(x):
        hidden.t.add_(torch.arange(2, device="tpu"))
        return x * 2

    def from_host(x):
        hidden.t.copy_(torch.ones(2))
        return x * 2

    for fn in (from_constants, from_host):
        with pytest.raises(RuntimeError, match="register_buffer"):
            torchjax.jit(fn)(torch.ones(2, device="tpu"))
        assert hidden.t.cpu().tolist() == [0.0, 0.0]
