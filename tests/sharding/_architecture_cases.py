"""Tensor-parallel loading of every architecture tests/integrations/tiny_models.py builds.

Run with the other cases in the 8-device subprocess (tests/sharding/_cases.py adds
``CASES`` to its own). The MoE architectures are tests/sharding/_moe_cases.py's, Qwen3
and Gemma 3 are _cases.py's own; here are the rest, each checkpoint written by
``save_pretrained`` as the Hub holds it and read back by transformers on CPU first:

- with a plan in transformers (Qwen3.5 under its multimodal parent's prefix, Qwen3-Next,
  T5Gemma in several files with their index): ``from_pretrained(path, device_map="tpu",
  tp_plan="auto")`` on a 4-device "tp" mesh gives CPU's logits, and every parameter is
  placed as transformers' own plan expansion for ``tp_size=4`` names it (split over
  "tp" on the dim its style splits, a quarter of its bytes per device; the rest whole
  on every device), ties and computed buffers as on CPU;
- without one (GPT-2, T5): the same call raises ``ValueError`` naming the model, as
  transformers raises for ``tp_size=4`` on such a model, and the call made (not
  ``parallelize``) and the ways out: a dict plan, which then loads and gives CPU's
  logits, or a load without ``tp_plan``. (On CPU in one process transformers derives
  ``tp_size=1`` from ``WORLD_SIZE`` and loads the model unsharded, as a 1-device "tp"
  mesh does; a 4-device one asks for four ranks' worth of tensor parallelism.)

``TINY_CASES`` names the case of every tiny architecture, here or in the other modules.

``DTYPES``: a load with ``dtype=`` (or none, from a bfloat16 checkpoint) gives every
parameter, buffer and config the dtype transformers gives them on CPU: the model's
``_keep_in_fp32_modules(_strict)`` kept in float32, buffers ``__init__`` makes in the
model's dtype, ``config.dtype`` set; a string dtype as ``from_pretrained`` takes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import jax
import torch
from transformers.distributed import DistributedConfig

import torchjax
import torchjax.sharding as ts
from tests.integrations import tiny_models as tiny
from tests.sharding._moe_cases import write_checkpoint
from torchjax.sharding import P

CASES: dict = {}
TP = 4

# name -> ((Auto class, config factory, attn_implementation), checkpoint prefix,
#          save_pretrained's max_shard_size)
PLANNED = {
    "qwen3_5": (tiny.ARCHITECTURES["qwen3_5"], "model.language_model.", None),
    "qwen3_next": (tiny.QWEN3_NEXT, None, None),
    "t5gemma": (tiny.T5GEMMA, None, "40KB"),
}
# name -> (Auto class, config factory, attn_implementation)
NO_PLAN = {"gpt2": tiny.ARCHITECTURES["gpt2"], "t5": tiny.ARCHITECTURES["t5"]}
# name -> a module rule of the plan a user passes such a model
NO_PLAN_RULES = {
    "gpt2": "transformer.h.*.mlp.c_fc",
    "t5": "encoder.block.*.layer.*.DenseReluDense.wi",
}

# case suffix -> (name, dtype the checkpoint is saved in, from_pretrained's dtype= or None)
DTYPES = {
    "deepseek_v3_auto": ("deepseek_v3", torch.bfloat16, None),
    "deepseek_v3_bf16_str": ("deepseek_v3", torch.float32, "bfloat16"),
    "gemma3_bf16": ("gemma3", torch.float32, torch.bfloat16),
    "gpt_oss_fp16": ("gpt_oss", torch.bfloat16, torch.float16),
}

# Every tiny architecture -> the case that loads it under tensor parallelism.
TINY_CASES = {
    "qwen3": "tp_qwen3_load_logits_generate",
    "gemma3": "tp_gemma3_computed_buffers_match_cpu",
    **{n: f"tp_load_{n}_hub" for n in ("qwen3_moe", "gemma4_moe", "deepseek_v3", "gpt_oss")},
    **{n: f"tp_load_{n}_hub" for n in PLANNED},
    **{n: f"tp_load_{n}_no_plan" for n in NO_PLAN},
}

# transformers' styles (transformers/distributed/parallel_utils.py) by the dim of an
# nn.Linear / nn.Embedding weight they split; every other style splits nothing.
_SPLIT_OUT = ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise")
_SPLIT_IN = ("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise")


def _expected_spec(style: str | None, name: str, ndim: int) -> P:
    """The placement a parameter of ``ndim`` dims named ``name`` takes under ``style``."""
    bias = name.endswith(".bias")
    if style in _SPLIT_OUT or style == "embedding_rowwise":
        assert ndim in (1, 2) and bias == (ndim == 1), (name, style, ndim)
        return P("tp") if bias else P("tp", None)
    if style in _SPLIT_IN:
        assert ndim in (1, 2) and bias == (ndim == 1), (name, style, ndim)
        return P() if bias else P(None, "tp")
    assert style != "embedding_colwise", name  # no tiny model's plan uses it
    return P()


def _inputs(model) -> dict:
    prompt = torch.randint(3, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": prompt}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = prompt[:, :5].clone()
    return batch


def _model(spec):
    auto, config, attn = spec
    torch.manual_seed(0)
    return auto.from_config(config(), attn_implementation=attn).eval()


def _ties(model) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(sorted(g) for g in names.values() if len(g) > 1)


def _close(a, b):
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=1e-4, rtol=1e-4)


def _bytes_per_device(t) -> int:
    return max(s.data.nbytes for s in torchjax.to_jax(t).addressable_shards)


def _check_planned(name: str):
    spec, prefix, max_shard_size = PLANNED[name]
    auto, _, attn = spec
    ref = _model(spec)
    batch = _inputs(ref)
    with torch.no_grad():
        want = ref(**batch).logits
    # Where transformers puts each parameter under tensor parallelism of TP ranks.
    plan, _, _ = ref._resolve_parallel_plans(DistributedConfig(tp_size=TP, tp_plan="auto"))
    path = tempfile.mkdtemp(prefix=f"tj_tp_{name}_")
    try:
        keys = write_checkpoint(ref, path, prefix=prefix, max_shard_size=max_shard_size)
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        assert (len(files) > 1) == (max_shard_size is not None), files
        if prefix is not None:
            assert all(k.startswith(prefix) for k in keys if "layers" in k), keys
        with torch.no_grad():  # the layout is one transformers itself reads
            cpu = auto.from_pretrained(path, attn_implementation=attn).eval()
            _close(cpu(**batch).logits, want)
        with torchjax.mesh((TP,), ("tp",), devices=jax.devices()[:TP]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = auto.from_pretrained(
                    path, device_map="tpu", tp_plan="auto", attn_implementation=attn
                )
            # No style left unplaced, no uneven dim replicated, no buffer left zero.
            ours = [str(w.message) for w in caught if "torchjax" in str(w.message)]
            assert not ours, ours
            with torch.no_grad():
                got = model(**{k: ts.shard(v, P()) for k, v in batch.items()}).logits
    finally:
        shutil.rmtree(path, ignore_errors=True)
    _close(got, want)
    assert _ties(model) == _ties(ref), (_ties(model), _ties(ref))
    for buffer, value in ref.named_buffers():
        _close(model.get_buffer(buffer), value)
    split = 0
    for param, p in model.named_parameters(remove_duplicate=False):
        sharding = ts.sharding_of(p)
        expected = _expected_spec(plan.get(param), param, p.dim())
        assert sharding.spec == expected, (param, plan.get(param), sharding.spec, expected)
        assert len(sharding.device_set) == TP, (param, sharding)
        full = p.numel() * p.element_size()
        if expected == P():
            assert _bytes_per_device(p) == full, param
        else:
            assert _bytes_per_device(p) * TP == full, (param, _bytes_per_device(p), full)
            split += 1
    assert split > 0, plan
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = [n for n in plan if n.endswith((".weight", ".bias")) and n not in params]
    assert not unknown, unknown  # the plan speaks of this model's parameters
    return {"split": split, "files": files, "keys": len(keys)}


def _check_no_plan(name: str):
    auto, _, attn = NO_PLAN[name]
    ref = _model(NO_PLAN[name])
    path = tempfile.mkdtemp(prefix=f"tj_tp_{name}_")
    try:
        write_checkpoint(ref, path)
        with torch.no_grad():  # the checkpoint itself is one transformers reads
            batch = _inputs(ref)
            want = ref(**batch).logits
            _close(auto.from_pretrained(path, attn_implementation=attn)(**batch).logits, want)
        try:  # transformers' answer for tensor parallelism over 4 ranks
            ref._resolve_parallel_plans(DistributedConfig(tp_size=TP, tp_plan="auto"))
        except ValueError as e:
            theirs = str(e)
            assert f"`{type(ref).__name__}` has no `tp_plan`" in theirs, theirs
        else:
            raise AssertionError(f"transformers planned tensor parallelism for {name}")
        cls = type(ref).__name__
        with torchjax.mesh((TP,), ("tp",), devices=jax.devices()[:TP]):
            # The error names the call made and the ways out (Note [Which plan applies]).
            for call, load in {
                "from_pretrained(..., tp_plan='auto')": lambda: auto.from_pretrained(
                    path, device_map="tpu", tp_plan="auto", attn_implementation=attn
                ),
                "torchjax.sharding.load_pretrained(..., TensorParallelConfig(plan='auto'))": (
                    lambda: ts.load_pretrained(auto, path, ts.TensorParallelConfig())
                ),
            }.items():
                try:
                    load()
                except ValueError as e:
                    ours = str(e)
                    assert ours.startswith(f"{call}: {cls} has no tensor-parallel plan"), ours
                    assert "Pass a plan naming its modules" in ours, ours
                    assert "load it without tensor parallelism" in ours, ours
                    assert "parallelize" not in ours, ours
                else:
                    raise AssertionError(f"a tensor-parallel load of {name} without a plan passed")
            # Taking the advice: a plan of its own modules loads, and gives CPU's logits.
            plan = {NO_PLAN_RULES[name]: "colwise"}
            theirs_plan, _, _ = _model(NO_PLAN[name])._resolve_parallel_plans(
                DistributedConfig(tp_size=TP, tp_plan=plan)
            )  # transformers accepts it
            model = auto.from_pretrained(
                path, device_map="tpu", tp_plan=plan, attn_implementation=attn
            )
            split = [n for n, p in model.named_parameters() if ts.sharding_of(p).spec != P()]
            assert split and set(split) <= set(theirs_plan), (split, theirs_plan)
            with torch.no_grad():
                _close(model(**{k: ts.shard(v, P()) for k, v in batch.items()}).logits, want)
        # One device is no tensor parallelism: the model loads unsharded, as transformers
        # loads it with tp_size=1.
        with torchjax.mesh((1,), ("tp",), devices=jax.devices()[:1]):
            model = auto.from_pretrained(
                path, device_map="tpu", tp_plan="auto", attn_implementation=attn
            )
            with torch.no_grad():
                _close(model(**{k: ts.shard(v, P()) for k, v in batch.items()}).logits, want)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"transformers": theirs[:120], "torchjax": ours[:160], "split": split}


def _check_dtype(case: str):
    name, saved, dtype = DTYPES[case]
    auto, _, attn = spec = tiny.ARCHITECTURES[name]
    ref = _model(spec).to(saved)
    batch = _inputs(ref)
    kwargs = {"attn_implementation": attn, **({} if dtype is None else {"dtype": dtype})}
    path = tempfile.mkdtemp(prefix=f"tj_tp_{case}_")
    try:
        write_checkpoint(ref, path)
        cpu = auto.from_pretrained(path, **kwargs).eval()
        with torchjax.mesh((TP,), ("tp",), devices=jax.devices()[:TP]):
            model = auto.from_pretrained(path, device_map="tpu", tp_plan="auto", **kwargs)
            with torch.no_grad():
                got = model(**{k: ts.shard(v, P()) for k, v in batch.items()}).logits
    finally:
        shutil.rmtree(path, ignore_errors=True)

    def dtypes(m):
        named = [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]
        configs = [m.config, *(getattr(m.config, k) for k in m.config.sub_configs)]
        return {n: t.dtype for n, t in named}, [c.dtype for c in configs if c is not None]

    (ours, our_configs), (theirs, their_configs) = dtypes(model), dtypes(cpu)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    differ = {n: (ours[n], theirs[n]) for n in theirs if ours[n] != theirs[n]}
    assert not differ and our_configs == their_configs, (differ, our_configs, their_configs)
    fp32 = sorted(n for n, d in dtypes(cpu)[0].items() if d == torch.float32)
    assert cpu.dtype != torch.float32 and fp32, fp32  # the dtype= and what it keeps apart
    with torch.no_grad():
        want = cpu(**batch).logits
    # Half-precision arithmetic: XLA's rounding differs from torch's on CPU.
    torch.testing.assert_close(got.cpu(), want, atol=2e-2, rtol=2e-2)
    return {"dtype": str(cpu.dtype), "float32": fp32}


def _case(name: str, check, suffix: str):
    def run():
        return check(name)

    run.__name__ = f"tp_load_{name}_{suffix}"
    CASES[run.__name__] = run


for _name in PLANNED:
    _case(_name, _check_planned, "hub")
for _name in NO_PLAN:
    _case(_name, _check_no_plan, "no_plan")
for _name in DTYPES:
    _case(_name, _check_dtype, "dtype")
