"""A user's ``tp_plan`` at load time, against transformers' own resolution of it.

Run with the other cases in the 8-device subprocess (tests/sharding/_cases.py adds
``CASES`` to its own). Note [Which plan applies] (torchjax/sharding/_plan.py): a dict
overrides rules of the model's plan, keys naming nothing raise, unknown styles raise and
rules naming nothing warn, each with transformers' message. transformers' answer comes
from ``model._resolve_parallel_plans(DistributedConfig(tp_size=4, tp_plan=...))`` on a
freshly built model each time (that call stores its result on the model: a second call
on the same model starts from the first one's plan).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import warnings

import jax
import torch
from transformers.distributed import DistributedConfig

import torchjax
import torchjax.sharding as ts
from tests.integrations import tiny_models as tiny
from tests.sharding._architecture_cases import _expected_spec
from torchjax.sharding import P

CASES: dict = {}
TP = 4


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _fresh(name: str):
    auto, config, attn = tiny.ARCHITECTURES[name]
    torch.manual_seed(0)
    return auto.from_config(config(), attn_implementation=attn).eval()


def _saved(name: str) -> str:
    path = tempfile.mkdtemp(prefix=f"tj_plan_{name}_")
    _fresh(name).save_pretrained(path)
    return path


def _theirs(name: str, plan):
    """transformers' expanded plan for ``tp_plan=plan`` over TP ranks, or its ValueError."""
    try:
        expanded, _, _ = _fresh(name)._resolve_parallel_plans(
            DistributedConfig(tp_size=TP, tp_plan=plan)
        )
    except ValueError as e:
        return e
    return expanded


def _mesh():
    return torchjax.mesh((TP,), ("tp",), devices=jax.devices()[:TP])


def _refusal(load) -> ValueError:
    try:
        load()
    except ValueError as e:
        return e
    raise AssertionError("the load passed")


def _from_pretrained(name: str, path: str, plan):
    auto, _, attn = tiny.ARCHITECTURES[name]
    return auto.from_pretrained(path, device_map="tpu", tp_plan=plan, attn_implementation=attn)


def _load_pretrained(name: str, path: str, plan):
    auto = tiny.ARCHITECTURES[name][0]
    return ts.load_pretrained(auto, path, ts.TensorParallelConfig(plan=plan))


def _check_placement(model, expanded: dict) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = ts.sharding_of(p).spec
        want = _expected_spec(expanded.get(name), name, p.dim())
        assert spec == want, (name, expanded.get(name), spec, want)


@case
def tp_plan_dict_overrides_the_models_plan():
    # transformers keeps the model's other rules: ``own | user``.
    auto, _, attn = tiny.ARCHITECTURES["qwen3"]
    override = {"model.layers.*.self_attn.o_proj": "replicate"}
    expanded = _theirs("qwen3", override)
    assert expanded["model.layers.0.self_attn.o_proj.weight"] == "replicate", expanded
    assert expanded["model.layers.0.self_attn.q_proj.weight"] == "colwise", expanded
    ref = _fresh("qwen3")
    prompt = torch.randint(3, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt).logits
    path = _saved("qwen3")
    try:
        with _mesh():
            loads = {
                "tp_plan": lambda: _from_pretrained("qwen3", path, override),
                "distributed_config": lambda: auto.from_pretrained(
                    path,
                    device_map="tpu",
                    distributed_config=DistributedConfig(tp_plan=override),
                    attn_implementation=attn,
                ),
                "load_pretrained": lambda: _load_pretrained("qwen3", path, override),
            }
            for how, load in loads.items():
                model = load()
                _check_placement(model, expanded)
                with torch.no_grad():
                    got = model(ts.shard(prompt, P())).logits
                torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4, msg=how)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@case
def tp_plan_refusals_are_transformers():
    # Keys naming nothing (here without the CausalLM's "model." prefix) and unknown
    # styles: transformers' ValueError and message, word for word, whichever it names
    # first.
    plans = {
        "unknown key": {"layers.*.mlp.up_proj": "colwise"},
        "unknown style": {"model.layers.*.mlp.up_proj": "colwise_typo"},
        "unknown key and style": {"layers.*.mlp.up_proj": "colwise_typo"},
    }
    path = _saved("qwen3")
    messages = {}
    try:
        with _mesh():
            for what, plan in plans.items():
                theirs = _theirs("qwen3", plan)
                assert isinstance(theirs, ValueError), (what, theirs)
                for load in (_from_pretrained, _load_pretrained):
                    ours = _refusal(functools.partial(load, "qwen3", path, plan))
                    assert str(ours) == str(theirs), (what, str(ours), str(theirs))
                messages[what] = str(theirs)[:80]
            # {} applies no rule, and transformers refuses tensor parallelism without one.
            assert "has no `tp_plan`" in str(_theirs("qwen3", {}))
            ours = str(_refusal(functools.partial(_from_pretrained, "qwen3", path, {})))
            assert ours.startswith(
                "from_pretrained(..., tp_plan={}): the empty plan applies none of "
                "Qwen3ForCausalLM's rules"
            ), ours
            assert "tp_plan='auto' for its own rules" in ours, ours
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return messages


@case
def empty_tp_plan_applies_no_rule():
    # docs/sharding.md: ``{}`` applies no rule, the model's own included. Loading over a
    # "tp" axis of one device gives the model replicated (over more devices the load
    # refuses: tp_plan_refusals_are_transformers); ``parallelize(model, {})`` replicates
    # every parameter whatever the axis size, raising nothing.
    path = _saved("qwen3")
    try:
        with torchjax.mesh((1,), ("tp",), devices=jax.devices()[:1]):
            model = _from_pretrained("qwen3", path, {})
            specs = {n: ts.sharding_of(p).spec for n, p in model.named_parameters()}
        assert specs and all(s == P() for s in specs.values()), specs
    finally:
        shutil.rmtree(path, ignore_errors=True)
    with _mesh():
        model = ts.parallelize(_fresh("qwen3").to("tpu"), {})
        specs = {n: ts.sharding_of(p).spec for n, p in model.named_parameters()}
    assert specs and all(s == P() for s in specs.values()), specs


@case
def tp_plan_rules_naming_nothing_warn_as_transformers():
    # Qwen3-MoE's own plan has dense-MLP rules that name no module of its MoE layers:
    # transformers logs the line, torchjax warns it.
    logged = []

    class Record(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logger = logging.getLogger("transformers.distributed.mixin")
    handler = Record()
    logger.addHandler(handler)
    try:
        _theirs("qwen3_moe", "auto")
    finally:
        logger.removeHandler(handler)
    theirs = [m for m in logged if "match nothing" in m]
    assert len(theirs) == 1, logged
    auto, _, attn = tiny.ARCHITECTURES["qwen3_moe"]
    path = _saved("qwen3_moe")
    try:
        with _mesh(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto.from_pretrained(path, device_map="tpu", tp_plan="auto", attn_implementation=attn)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    ours = [str(w.message) for w in caught if "match nothing" in str(w.message)]
    assert ours == theirs, (ours, theirs)

    # parallelize(model, dict) sets the whole plan, as ``model.tp_plan = plan`` does, and
    # reports its rules that name nothing in the same words.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with _mesh(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.parallelize(model, {"0": "colwise", "1.weight": "rowwise", "2": "rowwise"})
    ours = [str(w.message) for w in caught if "match nothing" in str(w.message)]
    assert ours == ["`tp_plan` rules ['2'] match nothing in Sequential and will not be applied."], (
        ours
    )
    assert ts.sharding_of(model[1].weight).spec == P(None, "tp")
    return {"warning": theirs[0]}
