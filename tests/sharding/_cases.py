"""Every sharding check, run in ONE subprocess with 8 simulated CPU devices.

tests/sharding/conftest.py starts ``python -m tests.sharding._cases`` once per test
session with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set
before JAX starts its backend, so not in the pytest process, whose other tests see one
device); each case's outcome comes back as JSON and one pytest test asserts on it. Cases
share the tiny models built once here. Every numeric check compares with CPU PyTorch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings

import jax
import numpy as np
import torch

import torchjax
import torchjax.sharding as ts
from tests.sharding import _architecture_cases, _moe_cases, _plan_cases
from torchjax.sharding import P

CASES: dict = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def close(a, b, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=atol, rtol=rtol)


def bytes_per_device(t) -> int:
    return max(s.data.nbytes for s in torchjax.to_jax(t).addressable_shards)


# -- mesh ------------------------------------------------------------------------------
@case
def mesh_context_nesting_and_decorator():
    assert ts.get_mesh() is None
    with torchjax.mesh((2, 4), ("dp", "tp")) as outer:
        assert ts.get_mesh() is outer and dict(outer.shape) == {"dp": 2, "tp": 4}
        with torchjax.mesh((8,), ("tp",)) as inner:
            assert ts.get_mesh() is inner
            assert jax.sharding.get_mesh() is inner  # jax's own context: one source
        assert ts.get_mesh() is outer
    assert ts.get_mesh() is None

    @torchjax.mesh((4, 2), ("a", "b"))
    def axes():
        return ts.get_mesh().axis_names

    assert axes() == ("a", "b") and ts.get_mesh() is None
    for bad in [((3,), ("tp",)), ((2, 4), ("tp",))]:
        try:
            torchjax.mesh(*bad)
        except ValueError as e:
            assert "torchjax.mesh" in str(e)
        else:
            raise AssertionError(f"no error for {bad}")


@case
def mesh_one_device_is_noop():
    x = torch.randn(4, 6)
    with torchjax.mesh((1,), ("tp",), devices=jax.devices()[:1]):
        s = ts.shard(x.to("tpu"), P("tp", None))
        assert len(ts.sharding_of(s).device_set) == 1
        close(s * 2, x * 2)


# -- placement ---------------------------------------------------------------------------
@case
def shard_eager_ops_and_cpu_gather():
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    with torchjax.mesh((2, 4), ("dp", "tp")):
        xs = ts.shard(x.to("tpu"), P("dp", None))
        ws = ts.shard(w, P(None, "tp"))  # from CPU: placed block by block
        sh = ts.sharding_of(xs)
        assert isinstance(sh, jax.sharding.NamedSharding) and sh.spec == P("dp", None)
        assert ts.sharding_of(ws).spec == P(None, "tp")
        assert [s.data.shape for s in torchjax.to_jax(ws).addressable_shards][0] == (16, 3)
        y = torch.relu(xs @ ws).sum(-1) + xs[:, :3].mean(-1)  # view + ops on sharded data
        close(y, torch.relu(x @ w).sum(-1) + x[:, :3].mean(-1))
        xs[0].add_(1)  # in-place through a view of a sharded tensor
        close(xs, x + torch.nn.functional.pad(torch.ones(1, 16), (0, 0, 0, 7)))
        assert len(ts.sharding_of(xs @ ws).device_set) == 8  # results stay on the mesh
        for bad, err in [(P("tp", None), ValueError), (P("zz"), ValueError), ("tp", TypeError)]:
            try:
                ts.shard(torch.randn(6, 4, device="tpu"), bad)
            except err as e:
                assert "torchjax.sharding.shard" in str(e)
            else:
                raise AssertionError(f"no error for {bad}")
    assert ts.sharding_of(x) is None


@case
def writes_keep_the_placement():
    # Note [Writes keep the placement] (torchjax/tensor/_storage.py)
    x = torch.randn(8, 16)
    cache = torch.zeros(2, 4, 16, 8)
    with torchjax.mesh((2, 4), ("dp", "tp")):
        xs = ts.shard(x, P("dp", "tp"))
        cs = ts.shard(cache, P(None, "tp"))
        xs[0].add_(1)
        xs[:, 2:5] = 0
        xs.mul_(2)
        cs[:, :, 3] = torch.ones(2, 4, 8, device="tpu")
        cs.index_copy_(2, torch.tensor([5], device="tpu"), torch.ones(2, 4, 1, 8, device="tpu"))
        assert ts.sharding_of(xs).spec == P("dp", "tp"), ts.sharding_of(xs)
        assert ts.sharding_of(cs).spec == P(None, "tp"), ts.sharding_of(cs)
        x[0] += 1
        x[:, 2:5] = 0
        cache[:, :, 3] = 1
        cache[:, :, 5] = 1
        close(xs, x * 2)
        close(cs, cache)


@case
def shard_autograd_and_inplace_param():
    x = torch.randn(8, 4)
    lin = torch.nn.Linear(4, 8)
    ref_lin = torch.nn.Linear(4, 8)
    ref_lin.load_state_dict(lin.state_dict())
    lin.to("tpu")
    with torchjax.mesh((8,), ("tp",)):
        w_before = lin.weight
        ts.shard_(lin.weight, P("tp", None))
        assert lin.weight is w_before and lin.weight.requires_grad
        assert ts.sharding_of(lin.weight).spec == P("tp", None)
        xt = x.to("tpu").requires_grad_()
        out = ts.shard(lin(xt), P(None, "tp")).pow(2).sum()
        out.backward()
        xr = x.clone().requires_grad_()
        ref_lin(xr).pow(2).sum().backward()
        close(out, ref_lin(x).pow(2).sum())
        close(lin.weight.grad, ref_lin.weight.grad)
        close(xt.grad, xr.grad)


@case
def constraint_inside_jit():
    x = torch.randn(8, 16)
    with torchjax.mesh((2, 4), ("dp", "tp")):

        def f(a):
            h = ts.constraint(torch.tanh(a) * 3, P("dp", "tp"))
            return h.sum(0), h

        jf = torchjax.jit(f)
        s, h = jf(x.to("tpu"))
        close(s, (torch.tanh(x) * 3).sum(0))
        assert ts.sharding_of(h).spec == P("dp", "tp")
        text = jax.make_jaxpr(lambda a: torchjax.to_jax(f(torchjax.from_jax(a))[0]))(
            torchjax.to_jax(x.to("tpu"))
        )
        assert "sharding_constraint" in str(text)


# -- tensor parallelism -----------------------------------------------------------------
_MODELS: dict = {}


def _tiny(kind: str):
    """(checkpoint dir, CPU model, prompt) for a tiny seeded Llama or Qwen3, built once."""
    if kind in _MODELS:
        return _MODELS[kind]
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config = (
        LlamaConfig(**common, tie_word_embeddings=True)
        if kind == "llama"
        else Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tempfile.mkdtemp(prefix=f"tj_shard_{kind}_")
    model.save_pretrained(path)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    _MODELS[kind] = (path, model, prompt)
    return _MODELS[kind]


def _check_tp_load(kind: str, new_tokens: int):
    from transformers import AutoModelForCausalLM

    path, ref, prompt = _tiny(kind)
    with torch.no_grad():
        ref_logits = ref(prompt).logits
    ref_tokens = ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    with torchjax.mesh((2, 4), ("dp", "tp")):  # TP=4 on 8 devices, replicated over dp
        if kind == "llama":
            config = ts.TensorParallelConfig(plan="auto")
            model = ts.load_pretrained(AutoModelForCausalLM, path, config)
        else:  # transformers' own spelling, routed by torchjax's from_pretrained hook
            model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", tp_plan="auto")
        ids = ts.shard(prompt, P())
        with torch.no_grad():
            logits = torchjax.jit(model)(ids).logits
        close(logits, ref_logits)
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        assert tokens.cpu().tolist() == ref_tokens.tolist(), (tokens.cpu(), ref_tokens)
    # Parameter bytes per device: 1/TP for every sharded weight.
    sharded = 0
    for name, p in model.named_parameters():
        full = p.numel() * p.element_size()
        spec = ts.sharding_of(p).spec
        if any(a is not None for a in spec):
            sharded += 1
            assert bytes_per_device(p) * 4 == full, (name, spec)
        else:
            assert bytes_per_device(p) == full, name
    assert sharded >= 14, sharded  # 7 linears x 2 layers (+ embeddings / lm_head)
    return model


@case
def tp_llama_load_logits_generate():
    from torchjax.integrations.transformers import compile_generate

    model = _check_tp_load("llama", new_tokens=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied
    assert ts.sharding_of(model.model.embed_tokens.weight).spec == P("tp", None)
    # compile_generate on the TP=4 model: the prefill, then the decode program and its
    # loop (Note [Decode steps as one program]) over sharded weights, = CPU.
    _, ref, prompt = _tiny("llama")
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    with torchjax.mesh((2, 4), ("dp", "tp")):
        compile_generate(model)
        with torch.no_grad():
            got = model.generate(
                ts.shard(prompt, P()),
                max_new_tokens=6,
                do_sample=False,
                cache_implementation="static",
            )
    assert got.cpu().tolist() == want.tolist(), (got.cpu(), want)
    # _check_tp_load's generate already ran the programs (the default on tpu).
    assert model.forward.decode_step.trace_count <= 4


@case
def tp_qwen3_load_logits_generate():
    model = _check_tp_load("qwen3", new_tokens=2)
    assert ts.sharding_of(model.model.layers[0].self_attn.q_norm.weight).spec == P()
    assert ts.sharding_of(model.lm_head.weight).spec == P("tp", None)


@case
def tp_gemma3_computed_buffers_match_cpu():
    # Gemma's embed_scale (sqrt(hidden)) is a non-persistent buffer __init__ computes; the
    # TP loader zero-filled it, and the logits were wrong (Note [Buffers a checkpoint
    # lacks]). Rotary tables of both layer kinds are computed too.
    import warnings

    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).eval()
    path = tempfile.mkdtemp(prefix="tj_shard_gemma3_")
    ref.save_pretrained(path)
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt).logits
    with torchjax.mesh((2, 4), ("dp", "tp")), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no buffer left zero
        model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", tp_plan="auto")
        with torch.no_grad():
            got = model(ts.shard(prompt, P())).logits
    close(got, want)
    for name, buf in ref.named_buffers():
        close(model.get_buffer(name), buf)
    return {"buffers": [n for n, _ in ref.named_buffers()]}


@case
def parallelize_plan_dict_styles_and_constraints():
    from transformers import AutoModelForCausalLM

    path, ref, prompt = _tiny("llama")
    plan = {
        "model.embed_tokens": "embedding_colwise",
        "model.layers.*.self_attn.q_proj": "colwise_rep",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise_rep",
        "model.layers.*.input_layernorm": "sequence_parallel",
        "model.norm.weight": "replicate",
    }
    model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu").eval()
    with torchjax.mesh((8,), ("tp",)):
        ts.parallelize(model, plan, activation_constraints=True)
        emb = model.model.embed_tokens.weight
        assert ts.sharding_of(emb).spec == P(None, "tp") and emb is model.lm_head.weight
        attn = model.model.layers[1].self_attn
        assert ts.sharding_of(attn.o_proj.weight).spec == P(None, "tp")
        assert ts.sharding_of(attn.q_proj.weight).spec == P("tp", None)
        with torch.no_grad():  # compiled: the hooks' constraints go into the program
            close(torchjax.jit(model)(ts.shard(prompt, P())).logits, ref(prompt).logits)
        try:
            ts.parallelize(model, {"model.norm": "diagonal"})
        except ValueError as e:
            assert "diagonal" in str(e)
        else:
            raise AssertionError("unknown style accepted")


@case
def parallelize_cpu_model_keeps_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    model[1].weight = model[0].weight
    x = torch.randint(0, 16, (3,))
    ref = model(x)
    with torchjax.mesh((8,), ("tp",)):
        ts.parallelize(model, {"0": "embedding_rowwise", "1": "colwise"})
        assert model[0].weight is model[1].weight
        assert ts.sharding_of(model[1].weight).spec == P("tp", None)
        assert ts.sharding_of(model[1].bias).spec == P("tp")
        model.to("tpu")  # moves the rest; keeps the placed parameters' shardings
        assert ts.sharding_of(model[1].weight).spec == P("tp", None)
        close(model(x.to("tpu")), ref)


@case
def plan_matching_follows_transformers():
    from transformers.distributed.parallel_utils import _get_parameter_plan

    path, ref, _ = _tiny("qwen3")
    plan = ts._plan.resolve_plan(ref, "auto")
    assert plan == ref.tp_plan
    for name, _ in ref.named_parameters():
        assert ts._plan.style_for(name, plan) == _get_parameter_plan(name, plan), name


@case
def uneven_dims_replicate_with_warning():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 8)).to("tpu")
    with torchjax.mesh((4,), ("tp",), devices=jax.devices()[:4]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts.parallelize(model, {"0": "colwise", "1": "rowwise"})
        assert any("not divisible" in str(w.message) for w in caught)
        assert ts.sharding_of(model[0].weight).spec == P()
        x = torch.randn(3, 8)
        close(model(x.to("tpu")), model.cpu()(x))


# -- data parallel / FSDP ----------------------------------------------------------------
@case
def dp_fsdp_jit_train_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ref.load_state_dict(net.state_dict())
    net.to("tpu")
    batches = [(torch.randn(16, 16), torch.randn(16, 8)) for _ in range(3)]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    with torchjax.mesh((2, 4), ("dp", "fsdp")):
        for p in net.parameters():  # FSDP: every parameter's dim 0 split over "fsdp"
            ts.shard_(p, P("fsdp"))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

        @torchjax.jit
        def step(x, y):
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        losses = []
        for x, y in batches:  # batch split over both axes (dp x fsdp = 8 devices)
            xs, ys = ts.shard(x, P(("dp", "fsdp"))), ts.shard(y, P(("dp", "fsdp")))
            losses.append(step(xs, ys).item())
        assert step.trace_count <= 2, step.trace_count
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for p, q in zip(net.parameters(), ref.parameters()):
            close(p, q, atol=1e-5, rtol=1e-5)
        w = net[0].weight
        assert ts.sharding_of(w).spec == P("fsdp"), ts.sharding_of(w)
        assert bytes_per_device(w) * 4 == w.numel() * 4


def _jit_train_step(lin, opt):
    """A torchjax.jit step of ``lin`` under ``opt`` on a squared-output loss."""

    @torchjax.jit
    def step(x):
        loss = lin(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


@case
def jit_adamw_step_mixed_placement():
    # One parameter sharded, the other as .to("tpu") left it (uncommitted on tpu:0): the
    # first compiled AdamW step copies held buffers before donating them, and the copy
    # must stay uncommitted to join the mesh's program.
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    xs = torch.randn(4, 16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_losses = []
    with torchjax.mesh((4,), ("tp",), devices=jax.devices()[:4]):
        lin = torch.nn.Linear(16, 8).to("tpu")
        lin.load_state_dict(ref.state_dict())
        ts.shard_(lin.weight, P("tp", None))
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        x = xs.to("tpu")
        step = _jit_train_step(lin, opt)

        losses = [step(x).item() for _ in range(2)]
    for _ in range(2):
        loss = ref(xs).square().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(lin.parameters(), ref.parameters()):
        close(p, q, atol=1e-5, rtol=1e-5)
    assert ts.sharding_of(lin.weight).spec == P("tp", None)
    return losses


@case
def jit_input_off_the_mesh_names_it():
    # A parameter committed to a device outside the mesh cannot join its program: the
    # error names it, its devices, the mesh and the fix, and prints no program.
    with torchjax.mesh((2,), ("tp",), devices=jax.devices()[:2]):
        lin = torch.nn.Linear(16, 8).to("tpu")
        ts.shard_(lin.weight, P("tp", None))
        lin.bias.data = lin.bias.data.to("tpu:5")
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        step = _jit_train_step(lin, opt)

        try:
            step(torch.randn(4, 16, device="tpu"))
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError("no error for a parameter off the mesh")
    return msg


CASES.update(_moe_cases.CASES)  # Hub-layout MoE checkpoints under tensor parallelism
CASES.update(_architecture_cases.CASES)  # the other tiny architectures, with or without a plan
CASES.update(_plan_cases.CASES)  # a user's tp_plan dict, as transformers resolves it


def main() -> None:
    assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"
    names = sys.argv[1:] or list(CASES)
    results = {}
    for name in names:
        start = time.process_time()
        try:
            results[name] = {"ok": True, "value": CASES[name]()}
        except Exception:  # noqa: BLE001  (reported to the pytest process, which fails)
            results[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
        results[name]["cpu_s"] = round(time.process_time() - start, 2)
    for path, _, _ in _MODELS.values():
        shutil.rmtree(path, ignore_errors=True)
    print("TORCHJAX_RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
