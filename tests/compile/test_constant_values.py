"""Note [Values made from constants inside a trace] (torchjax/ops/executables.py): under
``torchjax.jit`` an op whose arguments are all concrete gives a concrete value, so code
that reads values when they are known (transformers' mask shortcuts) does so as in eager;
values from the program's inputs, and large values, stay computations of the program."""

import json

import jax
import pytest
import torch
import transformers as tf

import torchjax
from examples import tiny_llama_generate as tl
from tests._child import run_python


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


def test_views_read_before_an_op_inside_a_trace_stay_concrete():
    # Once an overload has seen a few signatures of a key that reads views, it reads its
    # views first, through each view's read program (Note [Views in keys whose shapes
    # vary]); inside a trace that read was staged. After eager ``diff`` of expanded
    # position ids of a few lengths, a traced Llama's position ids' ``diff`` was a
    # tracer, so transformers passed SDPA a (B, 1, S, S) mask and repeated the key/value
    # heads, depending on what had run before in the process. A fresh process: the
    # overloads' counts are this code's.
    out = run_python(
        """
        import json

        import jax
        import torch
        import transformers as tf

        import torchjax
        from examples import tiny_llama_generate as tl
        from torchjax._compat.jax import trace_state_clean
        from torchjax.ops.view_signatures import MAX_VIEW_SIGNATURES
        from torchjax.tensor import _view_plans

        for n in range(3, 5 + MAX_VIEW_SIGNATURES):
            p = torch.arange(n, device="tpu").unsqueeze(0).expand(2, n)
            torch.diff(p, prepend=p[:, :1] - 1, dim=-1)

        reads, calls = [], []
        read_array = _view_plans._Plan.read_array

        def spy_read(self, arr, offset=None):
            out = read_array(self, arr, offset)
            if not (trace_state_clean() or isinstance(arr, jax.core.Tracer)):
                reads.append(isinstance(out, jax.core.Tracer))
            return out

        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy_sdpa(q, k, v, attn_mask=None, is_causal=False, **kw):
            calls.append([attn_mask is None, is_causal, kw.get("enable_gqa", False), k.shape[1]])
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

        torch.manual_seed(0)
        cpu = tf.LlamaForCausalLM(tl.tiny_llama_config()).eval()
        model = tf.LlamaForCausalLM(tl.tiny_llama_config()).eval()
        model.load_state_dict(cpu.state_dict())
        model.to("tpu")
        ids = torch.randint(0, 128, (2, 16))
        with torch.no_grad():
            want = cpu(ids, use_cache=False).logits
        _view_plans._Plan.read_array = spy_read
        torch.nn.functional.scaled_dot_product_attention = spy_sdpa
        got = torchjax.jit(lambda ids: model(ids, use_cache=False).logits)(ids.to("tpu"))
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)
        print(json.dumps({"reads": reads, "calls": calls}))
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # The position ids' views were read before the op, inside the trace: the case ran.
    assert seen["reads"] and not any(seen["reads"]), seen
    assert seen["calls"] == [[True, True, True, 2]] * 2, seen
