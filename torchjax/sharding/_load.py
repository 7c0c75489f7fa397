"""Loading a transformers model straight into tensor-parallel shardings.

``load_pretrained(AutoModelForCausalLM, path, TensorParallelConfig(tp_size=4))`` builds the
model on the meta device (no memory), computes every parameter's ``NamedSharding`` from
the plan (torchjax/sharding/_plan.py), then reads each parameter from the safetensors
files block by block with ``torchjax.checkpoint.load(path, sharding=...)``: every
device's block is read from the file on its own and placed on that device, so neither
host memory nor any device ever holds the whole model. Under ``jax.distributed`` each
process reads only the blocks of its own devices. Checkpoint names become parameter
names through transformers' own conversion mapping, as in ``from_pretrained``; a
parameter built from several tensors (one MoE layer's per-expert weights) is built on
the host and then placed (Note [Checkpoint layouts in tensor-parallel loading] in
torchjax/sharding/_conversions.py).

This is transformers' ``from_pretrained(path, distributed_config=DistributedConfig(
tp_plan="auto", tp_size=4))`` (``tp_plan="auto"`` in older spellings) for torchjax: the
config's ``plan`` takes the same values (``"auto"`` or a ``{pattern: style}`` dict).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any

import jax
import torch
from jax.sharding import Mesh, NamedSharding

from torchjax import checkpoint
from torchjax.checkpoint import SafetensorsFile
from torchjax.device._mesh import get_mesh, make_mesh
from torchjax.sharding._conversions import checkpoint_layout, run_converter
from torchjax.sharding._placement import shard
from torchjax.sharding._plan import load_plan, shardings_for
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import wrap


@dataclasses.dataclass
class TensorParallelConfig:
    """How to shard a model at load time.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` (may have more axes than ``axis``, which then
            replicate); default: the active ``torchjax.mesh``, else a 1-D mesh of the
            first ``tp_size`` devices.
        plan: ``"auto"`` (the model's own ``tp_plan``) or a ``{pattern: style}`` dict
            overriding rules of it, as transformers' ``DistributedConfig(tp_plan=...)``
            (Note [Which plan applies] in torchjax/sharding/_plan.py).
        axis: the mesh axis the plan shards over.
        tp_size: the number of devices, when no mesh is given or active (default: all).
    """

    mesh: Mesh | None = None
    plan: Any = "auto"
    axis: str = "tp"
    tp_size: int | None = None

    def resolve_mesh(self) -> Mesh:
        if self.mesh is not None:
            return self.mesh
        active = get_mesh()
        if active is not None and self.axis in active.axis_names:
            return active
        n = self.tp_size or jax.device_count()
        if n > jax.device_count():
            raise ValueError(
                f"TensorParallelConfig: tp_size={n} but JAX sees {jax.device_count()} devices"
            )
        return make_mesh((n,), (self.axis,), devices=jax.devices()[:n])


def load_pretrained(
    model_class,
    path: str,
    tp: TensorParallelConfig | None = None,
    *,
    dtype=None,
    key_mapping: dict | None = None,
    **config_kwargs,
) -> torch.nn.Module:
    """A transformers model from ``path``, its parameters sharded by ``tp`` on "tpu".

    Args:
        model_class: a ``PreTrainedModel`` class or an Auto class
            (``AutoModelForCausalLM``).
        path: a directory written by ``save_pretrained`` (config.json and
            model.safetensors, or a sharded checkpoint with its index json), tensors
            under the model's names or under those transformers' conversion mapping
            turns into them (per-expert MoE
            weights, older module names; Note [Checkpoint layouts in tensor-parallel
            loading] in torchjax/sharding/_conversions.py).
        tp: the sharding (default ``TensorParallelConfig()``: the model's plan over all
            devices or the active mesh's "tp" axis).
        dtype: the model's dtype, as ``from_pretrained(dtype=...)`` takes it (a torch
            dtype, its name, or ``"auto"``/None: the config's ``dtype``, else the
            checkpoint's); what the model keeps in float32 stays float32 (Note [The
            dtypes of a tensor-parallel load]).
        key_mapping: ``{regex: replacement}`` renaming checkpoint keys first, as
            ``from_pretrained(key_mapping=...)``.
        config_kwargs: passed to ``AutoConfig.from_pretrained``.

    Returns:
        The model in eval mode, on "tpu", every parameter a tpu tensor whose
        ``jax.Array`` is sharded as the plan says (tied weights stay one Parameter);
        non-persistent buffers (rotary ``inv_freq``) computed as transformers does and
        replicated.

    Raises:
        FileNotFoundError: no safetensors in ``path``. KeyError: a parameter missing from
        the checkpoint (other than tied ones). ValueError: a plan key that names nothing
        in the model, no plan over more than one device, a style transformers does not
        know (Note [Which plan applies] in torchjax/sharding/_plan.py). An error of a
        transformers conversion operation, as ``from_pretrained`` raises it.
    """
    return load_sharded(
        model_class, path, tp, dtype=dtype, key_mapping=key_mapping, **config_kwargs
    )


def load_sharded(
    model_class,
    path: str,
    tp: TensorParallelConfig | None = None,
    *,
    dtype=None,
    key_mapping: dict | None = None,
    caller: str = "load_pretrained",
    **config_kwargs,
) -> torch.nn.Module:
    """``load_pretrained``, its errors naming ``caller``: ``"load_pretrained"`` or
    ``"from_pretrained"`` (the transformers call torchjax routes here)."""
    from transformers import AutoConfig

    tp = tp or TensorParallelConfig()
    mesh = tp.resolve_mesh()
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    files = checkpoint.read_index(path)
    dtype = _model_dtype(dtype, config, files)
    with torch.device("meta"):  # built in ``dtype``, config.dtype set, as from_pretrained
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    plan = load_plan(model, tp.plan, mesh, tp.axis, caller)
    shardings = shardings_for(model, plan, mesh, tp.axis)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    with _HostReader(files) as host:
        layout = checkpoint_layout(model, files, host.read, key_mapping)

        # Each parameter's state-dict name that the checkpoint fills (a tied one is saved
        # under one of its names) and the sharding to read it with; buffers replicated.
        key_of, target_sharding = {}, {}
        names_of: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        for name, p in model.named_parameters(remove_duplicate=False):
            key = next((n for n in names_of[id(p)] if n in layout.targets), None)
            if key is None:
                raise KeyError(
                    f"torchjax.sharding.load_pretrained: parameter {name!r} is not in the "
                    f"checkpoint at {path}, under its own name or any transformers' conversion "
                    f"mapping gives it (tied: {name in tied})"
                )
            key_of[name] = key
            target_sharding.setdefault(key, shardings[name])
        replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
        tensors = _read_layout(
            layout,
            files,
            model,
            _target_dtypes(model, dtype),
            lambda n: target_sharding.get(n, replicated),
        )
    model._weight_conversions = layout.used  # as from_pretrained: save_pretrained reverts them

    loaded: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = key_of[name]
        new = loaded.get(key)
        if new is None:
            new = loaded[key] = torch.nn.Parameter(tensors.pop(key), requires_grad=p.requires_grad)
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = new
    _materialize_buffers(model, mesh, tensors)
    if os.path.exists(os.path.join(path, "generation_config.json")) and hasattr(
        model, "generation_config"
    ):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


class _HostReader:
    """Checkpoint tensors as CPU torch tensors, for transformers' conversion operations;
    each file opened once, all closed on exit."""

    def __init__(self, files: dict[str, str]):
        self._files, self._open = files, {}

    def read(self, key: str) -> torch.Tensor:
        path = self._files[key]
        file = self._open.get(path)
        if file is None:
            file = self._open[path] = SafetensorsFile(path)
        return dtypes.numpy_to_cpu_tensor(file.read(key))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for file in self._open.values():
            file.close()


def _read_layout(layout, files, model, dtype_of, sharding_of) -> dict[str, torch.Tensor]:
    """``{state-dict name: tpu tensor}`` for every target of ``layout``, in
    ``dtype_of(name)`` (None: as stored) and placed with ``sharding_of(name)``: tensors
    under their own (or a renamed) key read block by block from the files, converted ones
    built on the host and placed block by block (Note [Checkpoint layouts in
    tensor-parallel loading])."""
    groups: dict[tuple[str, torch.dtype | None], dict[str, str]] = {}
    for target, key in layout.direct.items():
        groups.setdefault((files[key], dtype_of(target)), {})[key] = target
    out = {}
    for (file, dtype), target_of in groups.items():
        read = checkpoint.load_file(
            file,
            dtype=dtype,
            sharding=lambda key, target_of=target_of: sharding_of(target_of[key]),
            keys=list(target_of),
        )
        for key, t in read.items():
            out[target_of[key]] = _check_shape(t, target_of[key], key, layout)
    for first, converter in layout.converted.items():
        for name, value in run_converter(converter, first, model).items():
            if name not in layout.targets:
                continue
            _check_shape(value, name, first, layout)
            dtype = dtype_of(name)
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            out[name] = shard(value, sharding_of(name))
    return out


# Note [The dtypes of a tensor-parallel load]
# ``from_pretrained(dtype=...)`` resolves ``dtype`` first (``_get_dtype``: a name becomes
# the torch dtype, ``"auto"`` - its default - the config's ``dtype``, else the
# checkpoint's first floating tensor's; the config and its sub-configs take it), builds
# the model with it as torch's default dtype, and reads every checkpoint tensor into the
# dtype of the parameter or buffer it fills - ``dtype``, or the one ``__init__`` gave it
# explicitly - except where the model's dtype plan (``_get_dtype_plan``: its
# ``_keep_in_fp32_modules_strict`` under float16 or bfloat16, ``_keep_in_fp32_modules``
# under float16) says float32 (transformers/core_model_loading.py,
# ``convert_and_load_state_dict_in_model``). The tensor-parallel loader calls the same
# functions; a DeepSeek-V3 router read into bfloat16 where transformers keeps it in
# float32 was the earlier way (one ``dtype`` cast over every floating tensor, or none:
# as stored). Buffers ``__init__`` computes are made in the meta model's dtypes (Note
# [Buffers a checkpoint lacks]). Written against transformers 5.24.
def _model_dtype(dtype, config, files: dict[str, str]) -> torch.dtype:
    """``from_pretrained``'s resolution of ``dtype`` (None as ``"auto"``); sets
    ``config.dtype`` and its sub-configs' (Note [The dtypes of a tensor-parallel load])."""
    from transformers.modeling_utils import _get_dtype

    _, dtype = _get_dtype(
        "auto" if dtype is None else dtype,
        checkpoint_files=sorted(set(files.values())),  # "auto" without a config dtype reads [0]
        config=config,
        sharded_metadata=None,
        state_dict=None,
        weights_only=True,
    )
    return dtype


def _target_dtypes(model, dtype: torch.dtype):
    """``dtype_of(state-dict name)``: the dtype transformers reads that tensor into
    (None: a non-floating tensor, kept as stored), Note [The dtypes of a tensor-parallel
    load]."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    meta = {name: t.dtype for name, t in model.state_dict().items()}
    if plan:
        pattern, glob_of, _ = build_glob_alternation(list(plan))

    def dtype_of(name: str) -> torch.dtype | None:
        if plan and (match := pattern.search(name)) is not None:
            return plan[glob_of[match.lastgroup]]
        return meta[name] if meta[name].is_floating_point else None

    return dtype_of


def _check_shape(t: torch.Tensor, name: str, key: str, layout) -> torch.Tensor:
    if tuple(t.shape) != layout.shapes[name]:
        raise ValueError(
            f"torchjax.sharding.load_pretrained: the checkpoint's {key!r} gives {name!r} the "
            f"shape {tuple(t.shape)}, but the model's is {layout.shapes[name]}"
        )
    return t


# Note [Buffers a checkpoint lacks]
# A model built on the meta device has no values for its non-persistent buffers, which
# ``__init__`` computes (rotary tables, Gemma's ``embed_scale = sqrt(hidden)``) and
# ``save_pretrained`` leaves out. transformers' loader recomputes them with the model's
# ``_init_weights``; so does this one, on a shadow of each owning module: the same class
# and buffers (CPU zeros to fill), its parameters swapped for meta tensors, so the
# initialisers run on nothing there and the loaded (sharded) weights are never written.
# A zero-filled buffer was the earlier way, and it gave a Gemma model wrong logits.
def _init_buffers(model, owner) -> None:
    """Runs ``model._init_weights`` on a shadow of ``owner`` whose parameters are meta
    tensors; ``owner``'s CPU buffers are filled in place."""
    shadow = copy.copy(owner)
    shadow.__dict__["_parameters"] = {
        n: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"))
        for n, p in owner._parameters.items()
    }
    shadow.__dict__["_buffers"] = owner._buffers  # the CPU zeros, filled in place
    with torch.no_grad():
        model._init_weights(shadow)


def _materialize_buffers(model, mesh, tensors: dict) -> None:
    """Buffers out of the meta device, replicated on the mesh: persistent ones from the
    checkpoint (``tensors``, already read), the others (rotary ``inv_freq``, Gemma's
    ``embed_scale``) computed on CPU by transformers' own ``_init_weights``, as
    ``from_pretrained`` does after loading (Note [Buffers a checkpoint lacks])."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    owners = {}
    for name, buf in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(module_name)
        if name in tensors:
            owner._buffers[attr] = tensors.pop(name)
        elif buf.device.type == "meta":
            owner._buffers[attr] = torch.zeros_like(buf, device="cpu")
            owners.setdefault(id(owner), (owner, []))[1].append((name, attr))
    unset = []
    for owner, attrs in owners.values():
        _init_buffers(model, owner)
        unset += [name for name, a in attrs if not owner._buffers[a].any()]
    if unset:
        warnings.warn(
            f"torchjax.sharding.load_pretrained: buffers {unset} are not in the checkpoint "
            "and the model's _init_weights left them zero; check that zero is their value",
            stacklevel=3,
        )

    for name, buf in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        if buf.device.type == "cpu":
            host = dtypes.cpu_tensor_to_numpy(buf)
            model.get_submodule(module_name)._buffers[attr] = wrap(jax.device_put(host, replicated))
