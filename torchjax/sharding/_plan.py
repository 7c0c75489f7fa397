"""Tensor parallelism with the Hugging Face plan vocabulary: ``parallelize(model, plan)``.

A plan maps module (or parameter) name patterns to styles, exactly as transformers'
``tp_plan`` does (``config.base_model_tp_plan``, e.g. ``"layers.*.self_attn.q_proj":
"colwise"``). Matching follows transformers' ``_get_parameter_plan``
(transformers/distributed/parallel_utils.py): a parameter's name with its layer numbers
replaced by ``*`` (``replace_layer_number_by_wildcard``: ``.3.`` -> ``.*.``) is looked up
in the plan, then the name of its module. Which plan applies - the model's own, a user's
dict over it at load time, a dict alone for ``parallelize`` - and how it is checked:
Note [Which plan applies].

Note [Tensor parallelism under GSPMD]
transformers implements each style with DTensors: local matmuls plus the collectives the
style implies (colwise: replicated input, output sharded on the last dim; rowwise: a
partial sum all-reduced), and forward hooks that redistribute activations. Under GSPMD
the program is written for one device and XLA partitions it from the shardings of its
inputs, inserting the same collectives itself. So a style here is only *where each
parameter's blocks live*:

- colwise (and colwise_rep, colwise_gather_output, packed_colwise): nn.Linear's weight
  ``[out, in]`` sharded on ``out`` (``P(axis, None)``; for 3-D expert weights the
  second-to-last dim), bias on its only dim;
- rowwise (and rowwise_rep, rowwise_split_input, packed_rowwise): weight sharded on
  ``in`` (``P(None, axis)``), bias replicated;
- packed_colwise / packed_rowwise hold two weights fused on the sharded dim (an MoE's
  gate and up). transformers gives each rank a block of each (a strided shard); a jax
  sharding splits a dim into contiguous blocks only, so here a device holds a block of
  the fused dim and XLA moves what splitting it into gate and up needs: the same
  numbers, some more communication;
- embedding_rowwise (vocab-parallel, transformers' default for ``embed_tokens``): weight
  ``[vocab, hidden]`` sharded on vocab; embedding_colwise: on hidden;
- replicate, replicated_with_grad_allreduce, sequence_parallel, all_reduce,
  local_params, mla_kv_a_proj, moe_identity_expert: parameters replicated (the gradient
  all-reduce of replicated_with_grad_allreduce is what XLA does for any replicated
  parameter; the others only change activations or gradients in transformers);
- moe_tp_experts, on an MoE block's experts module: in transformers it places no
  parameter itself (the experts' 3-D weights take their own entries, e.g.
  ``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``, each expert
  split over the axis) and all-reduces the experts' partial outputs, which XLA inserts
  here; an expert parameter without its own entry (a bias) stays replicated, as there.

The numbers are those of the unsharded model whatever the plan says; the plan decides
memory per device and communication. With ``activation_constraints=True`` the output
layouts the styles name are added as sharding constraints (colwise: last dim on the
axis; the ``_rep``/``rowwise`` styles: replicated; sequence_parallel: input dim 1 on the
axis), applied where the dims divide evenly.

A parameter whose sharded dim does not divide by the axis size is replicated (with one
warning listing them): jax places only even blocks, while transformers lets the last rank
hold a shorter one.
"""

from __future__ import annotations

import itertools
import re
import warnings

import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchjax.device._mesh import resolve_mesh
from torchjax.sharding._placement import constraint, shard, shard_
from torchjax.tensor._tensor import JaxTensor

_COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise")
_REPLICATED = (
    "replicate",
    "replicated_with_grad_allreduce",
    "sequence_parallel",
    "all_reduce",
    "local_params",
    "mla_kv_a_proj",
    "moe_identity_expert",
    "moe_tp_experts",
)
STYLES = frozenset(_COLWISE + _ROWWISE + _REPLICATED + ("embedding_rowwise", "embedding_colwise"))


def wildcard_name(name: str) -> str:
    """``name`` with layer numbers as ``*`` (transformers' replace_layer_number_by_wildcard)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def style_for(param_name: str, plan: dict) -> str | None:
    """The plan's style for a parameter: its own entry, else its module's (transformers'
    ``_get_parameter_plan`` rule); None when the plan names neither."""
    generic = wildcard_name(param_name)
    if generic in plan:
        return plan[generic]
    if "." in generic and (module := generic.rsplit(".", 1)[0]) in plan:
        return plan[module]
    return None


def param_spec(style: str, param_name: str, ndim: int, axis: str) -> PartitionSpec:
    """The ``PartitionSpec`` of one parameter under ``style`` (Note [Tensor parallelism
    under GSPMD]); ``param_name`` is the attribute name (``"weight"``, ``"bias"``)."""
    dim = None
    if style in _COLWISE:
        dim = ndim - 2 if ndim >= 2 else 0
    elif style in _ROWWISE:
        dim = None if param_name == "bias" else ndim - 1
    elif style == "embedding_rowwise":
        dim = 0
    elif style == "embedding_colwise":
        dim = 1 if ndim > 1 else None
    if dim is None:
        return PartitionSpec()
    return PartitionSpec(*(axis if d == dim else None for d in range(ndim)))


# ``_ACCEPTED``: every style transformers knows (its ALL_PARALLEL_STYLES, in the order
# a from_pretrained process registers them, for its "Supported styles are [...]").
# ``_UNPLACED``: those torchjax does not place, the expert-parallel ones, which split
# experts over ranks and dispatch tokens to them. A plan may name them, as in
# transformers; their parameters stay replicated, with a warning.
# tests/sharding/test_plan.py checks both against the installed transformers.
_UNPLACED = ("grouped_gemm", "ep_dispatch_experts")
_ACCEPTED = (
    "embedding_rowwise", "embedding_colwise", "colwise_gather_output", "colwise_rep",
    "colwise", "rowwise", "rowwise_split_input", "rowwise_rep", "packed_colwise",
    "packed_rowwise", "sequence_parallel", "replicated_with_grad_allreduce", "mla_kv_a_proj",
    "all_reduce", "moe_tp_experts", "moe_identity_expert", "local_params", "replicate",
    *_UNPLACED,
)  # fmt: skip

# Note [Which plan applies]
# transformers gives a model its plan in two ways, and torchjax follows each
# (transformers/distributed/mixin.py, written against 5.24):
#
# - Loading: ``from_pretrained(tp_plan=...)`` or ``DistributedConfig(tp_plan=...)``
#   (``_resolve_parallel_plans``). ``"auto"`` (or None) is the model's own plan; a dict
#   *overrides rules of it*: ``own | user``, the user's style winning where both name a
#   key, the model's other rules kept, and ``{}`` applying no rule at all. A user key
#   that is neither a module or parameter name (layer numbers as ``*``) nor a rule of the
#   model's own raises ``ValueError("`tp_plan` keys [...] match nothing in Cls.")``, and
#   an empty plan over more than one device raises ValueError (transformers: "has no
#   `tp_plan`"; here the message names the call and the way out). One device is no
#   tensor parallelism: a model without a plan loads, replicated, as transformers loads
#   it with ``tp_size=1``. ``load_pretrained`` with ``TensorParallelConfig(plan=...)``
#   and the ``from_pretrained`` it serves are this path (``load_plan``). A dict that
#   replaced the model's plan, its unmatched keys ignored, was the earlier way.
# - Setting: ``model.tp_plan = {...}`` replaces the plan. ``parallelize(model, dict)`` is
#   this path: the dict is the whole plan (``resolve_plan``).
#
# Both then check the plan as transformers' ``_validate_parallel_plan`` does: a style
# transformers does not know raises ``ValueError("Unsupported `tp_plan` styles: {...}.
# Supported styles are [...]")``, and rules that name nothing in the model are reported
# as "`tp_plan` rules [...] match nothing in Cls and will not be applied." transformers
# logs that line on its logger; torchjax gives it as a UserWarning, as it gives its other
# plan warnings (uneven dims, styles it does not place), so one ``warnings`` filter sees
# them all. Models' own plans can trigger it, as in transformers (Qwen3-MoE's dense MLP
# rules name no module of its all-MoE layers).


def model_plan(model: torch.nn.Module) -> dict:
    """The model's own plan (``{}`` when it has none): a transformers ``PreTrainedModel``'s
    ``model.tp_plan`` (its class ``_tp_plan``, e.g. ``{"lm_head": "colwise_gather_output"}``,
    merged with ``config.base_model_tp_plan`` under the base model's prefix and the
    vocab-parallel ``embed_tokens`` entry, as transformers builds it in
    ``init_parallel_plans``), else ``config.base_model_tp_plan`` prefixed with
    ``base_model_prefix`` when the model wraps its base model."""
    own = dict(getattr(model, "tp_plan", None) or {})
    if not own:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        if base and prefix and getattr(model, prefix, None) is not None:
            base = {f"{prefix}.{k}": v for k, v in base.items()}
        own = {**dict(getattr(type(model), "_tp_plan", None) or {}), **base}
    return own


def _rule_names(model: torch.nn.Module) -> set[str]:
    """What a plan's keys can name: every module and parameter, layer numbers as ``*``."""
    named = itertools.chain(model.named_modules(), model.named_parameters())
    return {wildcard_name(name) for name, _ in named}


def _example_rule(model: torch.nn.Module) -> str:
    """A plan key for an error message: the model's first layered module with a matrix."""
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        generic = wildcard_name(name)
        if "*" in generic and weight is not None and weight.dim() == 2:
            if not isinstance(module, torch.nn.Embedding):
                return generic
    return "layers.*.mlp.up_proj"


def _check(model: torch.nn.Module, plan: dict, names: set[str] | None = None) -> None:
    """transformers' ``_validate_parallel_plan`` (Note [Which plan applies]), and a
    warning for the styles torchjax does not place."""
    unsupported = {style for style in plan.values() if style not in _ACCEPTED}
    if unsupported:
        raise ValueError(
            f"Unsupported `tp_plan` styles: {unsupported}. Supported styles are {list(_ACCEPTED)}"
        )
    unplaced = sorted({style for style in plan.values() if style in _UNPLACED})
    if unplaced:
        warnings.warn(
            f"torchjax.sharding: the plan uses styles {unplaced} that torchjax does not place "
            "yet; their parameters stay replicated",
            stacklevel=4,
        )
    if unused := plan.keys() - (_rule_names(model) if names is None else names):
        warnings.warn(
            f"`tp_plan` rules {sorted(unused)} match nothing in {type(model).__name__} and "
            "will not be applied.",
            stacklevel=4,
        )


def resolve_plan(model: torch.nn.Module, plan) -> dict:
    """``parallelize``'s plan as a dict: ``"auto"`` the model's own (``model_plan``), a
    dict the whole plan, as ``model.tp_plan = plan`` sets it (Note [Which plan applies]).

    Raises:
        ValueError: ``"auto"`` on a model without a plan; a style transformers does not
            know. TypeError: neither a dict nor ``"auto"``.
    """
    if isinstance(plan, dict):
        resolved = dict(plan)
    elif plan == "auto":
        resolved = model_plan(model)
        if not resolved:
            raise ValueError(
                f"torchjax.sharding.parallelize: plan='auto' but {type(model).__name__} has no "
                "tensor-parallel plan (no model.tp_plan or config.base_model_tp_plan); pass a "
                f"dict such as {{{_example_rule(model)!r}: 'colwise', ...}}"
            )
    else:
        raise TypeError(
            f"torchjax.sharding.parallelize: plan must be a dict or 'auto', got {plan!r}"
        )
    _check(model, resolved)
    return resolved


# How each loading call spells a plan, for its errors: (the call, its plan argument).
_CALLS = {
    "from_pretrained": ("from_pretrained(..., tp_plan={plan})", "tp_plan={plan}"),
    "load_pretrained": (
        "torchjax.sharding.load_pretrained(..., TensorParallelConfig(plan={plan}))",
        "TensorParallelConfig(plan={plan})",
    ),
}


def load_plan(model: torch.nn.Module, plan, mesh, axis: str, caller: str) -> dict:
    """The plan a load applies, as transformers resolves ``DistributedConfig(tp_plan=plan)``:
    ``"auto"`` or None the model's own, a dict overriding rules of it (Note [Which plan
    applies]). ``caller`` is ``"from_pretrained"`` or ``"load_pretrained"``: the call the
    errors name.

    Raises:
        ValueError: a key that names nothing in the model and no rule of its own
            (transformers' message); no rule to shard with over more than one device; a
            style transformers does not know (transformers' message). TypeError: ``plan``
            is neither a dict nor ``"auto"``.
    """
    call, argument = _CALLS[caller]
    call = call.format(plan=repr(plan))
    size = _axis_size(mesh, axis, call)
    own = model_plan(model)
    names = _rule_names(model)
    if isinstance(plan, dict):
        if unknown := plan.keys() - names - own.keys():
            raise ValueError(
                f"`tp_plan` keys {sorted(unknown)} match nothing in {type(model).__name__}."
            )
        resolved = own | plan if plan else {}
    elif plan is None or plan == "auto":
        resolved = own
    else:
        raise TypeError(f"{call}: the plan must be a dict or 'auto', got {plan!r}")
    if size > 1 and not resolved:
        cls = type(model).__name__
        example = argument.format(plan=f"{{{_example_rule(model)!r}: 'colwise', ...}}")
        if own:
            why = f"the empty plan applies none of {cls}'s rules"
            example += f", or {argument.format(plan=repr('auto'))} for its own rules"
        else:
            why = (
                f"{cls} has no tensor-parallel plan (no model.tp_plan or config.base_model_tp_plan)"
            )
        raise ValueError(
            f"{call}: {why}, so nothing shards it over the {size} devices of mesh axis "
            f"{axis!r}. Pass a plan naming its modules, e.g. {example}, or load it without "
            "tensor parallelism: from_pretrained(path, device_map='tpu') without tp_plan."
        )
    _check(model, resolved, names)
    return resolved


def _axis_size(mesh, axis: str, call: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"{call}: axis {axis!r} is not a mesh axis {mesh.axis_names}")
    return mesh.shape[axis]


def plan_shardings(model: torch.nn.Module, plan, mesh=None, axis: str = "tp") -> dict:
    """``{parameter name: NamedSharding}`` for every parameter of ``model`` (tied ones
    under each of their names) without moving anything. ``plan``, ``mesh``, ``axis`` as
    for ``parallelize``. Parameters whose sharded dim does not divide evenly get a
    replicated sharding and are listed in one warning.
    """
    mesh = resolve_mesh(mesh, "torchjax.sharding.parallelize")
    _axis_size(mesh, axis, "torchjax.sharding.parallelize")
    return shardings_for(model, resolve_plan(model, plan), mesh, axis)


def shardings_for(model: torch.nn.Module, plan: dict, mesh, axis: str) -> dict:
    """``plan_shardings`` for a resolved ``plan`` (``resolve_plan``, ``load_plan``); used
    by loading too (on a meta-device model), which reads each device's block straight
    from the checkpoint."""
    size = mesh.shape[axis]
    out, uneven = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        shape = tuple(p.shape)
        style = style_for(name, plan)
        spec = PartitionSpec()
        if style is not None:
            spec = param_spec(style, name.rsplit(".", 1)[-1], len(shape), axis)
            for d, a in enumerate(spec):
                if a is not None and shape[d] % size:
                    uneven.append(f"{name} {shape}")
                    spec = PartitionSpec()
                    break
        out[name] = NamedSharding(mesh, spec)
    if uneven:
        warnings.warn(
            f"torchjax.sharding: replicated {len(uneven)} parameter(s) whose sharded dim is "
            f"not divisible by {axis}={size}: {', '.join(uneven[:8])}",
            stacklevel=3,
        )
    return out


def parallelize(
    model: torch.nn.Module,
    plan="auto",
    mesh=None,
    *,
    axis: str = "tp",
    activation_constraints: bool = False,
) -> torch.nn.Module:
    """Shard ``model``'s parameters (in place) for tensor parallelism.

    Args:
        model: a module on "tpu", or on CPU: its parameters then become new tpu
            Parameters placed block by block (the full tensor never on one device;
            tied parameters stay one Parameter; buffers stay where they are: move them
            with ``model.to("tpu")`` afterwards, which keeps the shardings).
        plan: ``{pattern: style}`` with transformers' styles and matching rules (see
            module docstring): the whole plan, as ``model.tp_plan = plan`` sets it in
            transformers (loading merges a dict into the model's own plan instead:
            Note [Which plan applies]); or ``"auto"`` for the model's own plan.
        mesh: the ``jax.sharding.Mesh`` (default: the active ``torchjax.mesh``). Axes
            other than ``axis`` replicate (e.g. a ``("dp", "tp")`` mesh).
        axis: the mesh axis the styles shard over.
        activation_constraints: also constrain module outputs to the layouts the styles
            name (Note [Tensor parallelism under GSPMD]); off by default: XLA's own
            propagation gives the same numbers.

    Returns:
        ``model``, whose parameters now hold sharded arrays. On "tpu" the Parameter
        objects are kept (tied weights stay tied, optimizers built before still see
        them).

    Raises:
        ValueError: no mesh, ``axis`` not in it, an unknown style, ``"auto"`` without a
            plan.

    Warns:
        UserWarning: rules that name nothing in ``model`` (transformers' words for them),
        and as ``plan_shardings``.
    """
    mesh = resolve_mesh(mesh, "torchjax.sharding.parallelize")
    _axis_size(mesh, axis, "torchjax.sharding.parallelize")
    plan = resolve_plan(model, plan)
    shardings = shardings_for(model, plan, mesh, axis)
    placed: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        new = placed.get(id(p))
        if new is None:
            if isinstance(p, JaxTensor):
                new = placed[id(p)] = shard_(p, shardings[name])
            else:  # a CPU parameter: placed block by block, a new Parameter (ties kept)
                with torch.no_grad():
                    value = shard(p, shardings[name])
                new = placed[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = new
    if activation_constraints:
        _install_constraints(model, plan, mesh, axis)
    return model


def _install_constraints(model, plan, mesh, axis):
    for name, module in model.named_modules():
        style = plan.get(wildcard_name(name))
        if style is None:
            continue
        if style == "sequence_parallel":
            module.register_forward_pre_hook(_SeqInput(mesh, axis))
        elif style in _COLWISE[:1]:
            module.register_forward_hook(_Output(mesh, axis))
        elif style in _COLWISE[1:] or style in _ROWWISE:
            module.register_forward_hook(_Output(mesh, None))


class _Output:
    """Forward hook: output's last dim on ``axis`` (None: replicated), when it divides."""

    def __init__(self, mesh, axis):
        self.mesh, self.axis = mesh, axis

    def __call__(self, module, args, out):
        if not isinstance(out, torch.Tensor) or out.device.type != "tpu":
            return out
        if self.axis is None:
            return constraint(out, PartitionSpec(), self.mesh)
        if out.dim() == 0 or out.shape[-1] % self.mesh.shape[self.axis]:
            return out
        return constraint(out, PartitionSpec(*([None] * (out.dim() - 1)), self.axis), self.mesh)


class _SeqInput:
    """Forward pre-hook: first input's dim 1 (sequence) on ``axis``, when it divides."""

    def __init__(self, mesh, axis):
        self.mesh, self.axis = mesh, axis

    def __call__(self, module, args):
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return None
        x = args[0]
        if x.device.type != "tpu" or x.shape[1] % self.mesh.shape[self.axis]:
            return None
        return (constraint(x, PartitionSpec(None, self.axis), self.mesh), *args[1:])
