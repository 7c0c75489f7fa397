"""Which checkpoint tensors make which model parameter: transformers' weight conversions.

Note [Checkpoint layouts in tensor-parallel loading]
A checkpoint's tensor names are not always the model's parameter names. Hub checkpoints
of MoE models store one weight per expert (``mlp.experts.3.gate_proj.weight``), where
transformers 5 models hold one fused tensor per layer (``mlp.experts.gate_up_proj``,
experts stacked, gate and up concatenated); older ones use older module names (Mixtral's
``block_sparse_moe.experts.0.w1``); a text model may be read from its multimodal
parent's checkpoint (``model.language_model.``). ``save_pretrained`` writes the per-expert
layout back, and a checkpoint may also hold the fused tensors under the model's own names.
``from_pretrained`` accepts all of these through its conversion mapping
(transformers/conversion_mapping.py): renamings, and converters whose operations (stack,
concatenate, chunk, transpose) build a parameter from several checkpoint tensors
(transformers/core_model_loading.py, ``convert_and_load_state_dict_in_model``).

The tensor-parallel loader uses the same machinery, not a copy of its rules: the
model's mapping from ``get_model_conversion_mapping`` and each checkpoint key renamed by
``rename_source_key``, in transformers' key order (``dot_natural_key``: expert 10 after
expert 9), grouped per target as transformers groups them. Then:

- a key that only renames (or keeps its name) is read straight into its parameter's
  sharding, each device reading its own block (Note [One device's slice at a time] in
  torchjax/checkpoint/_load.py);
- a converter's sources are read to host memory and converted there by the converter's
  own ``convert`` (transformers' torch ops on CPU tensors, as its loader does for
  converters marked ``force_cpu``), and the result is placed block by block on the
  mesh. One converted parameter (say, one layer's experts) is on the host at a time; no
  device ever holds more than its block. transformers' own TP loader reads only the
  experts a rank owns; under GSPMD a rank is a device, and every process here reads a
  converted parameter whole.

Checkpoint keys that no parameter or buffer takes are left unread, as ``from_pretrained``
reports them as unexpected and goes on. Written against transformers 5.24
(``rename_source_key``, ``WeightConverter.add_tensor``/``convert``);
tests/sharding/test_conversions.py fails if those move.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch


@dataclasses.dataclass
class CheckpointLayout:
    """How a checkpoint's keys fill a model's state dict.

    Attributes:
        direct: ``{state-dict name: checkpoint key}`` for tensors read as they are
            (renamed or not).
        converted: ``{first target name: WeightConverter}``, each converter holding its
            source keys (read lazily) in transformers' order.
        targets: every state-dict name the checkpoint fills.
        shapes: ``{state-dict name: shape}`` of the model.
        used: the conversions that matched a key (transformers keeps them on the model
            as ``_weight_conversions``, so ``save_pretrained`` writes the layout back).
    """

    direct: dict
    converted: dict
    targets: set
    shapes: dict
    used: list


def checkpoint_layout(model, keys, read, key_mapping=None) -> CheckpointLayout:
    """The ``CheckpointLayout`` of checkpoint ``keys`` for ``model`` (on the meta device).

    Args:
        model: a transformers ``PreTrainedModel``.
        keys: the checkpoint's tensor names.
        read: ``read(key) -> torch.Tensor`` on CPU, called only when a converter runs.
        key_mapping: ``from_pretrained``'s ``key_mapping`` (``{regex: replacement}``).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model, key_mapping)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    meta = model.state_dict()

    direct, converted, targets = {}, {}, set()
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:  # as transformers: a key the model has keeps it
            target, pattern = rename_source_key(key, [], [], prefix, meta)
        if target not in meta:
            continue
        if pattern is None:
            direct.setdefault(target, key)
            targets.add(target)
            continue
        converter = converted.get(target)
        if converter is None:
            converter = converted[target] = copy.deepcopy(by_pattern[pattern])
            first = converter.target_patterns[0]
            names = (target.replace(first, t, 1) for t in converter.target_patterns)
            targets.update(name for name in names if name in meta)
        converter.add_tensor(target, key, pattern, functools.partial(read, key))
    shapes = {name: tuple(t.shape) for name, t in meta.items()}
    used = [t for t in mapping if t.was_used()]
    return CheckpointLayout(direct, converted, targets, shapes, used)


def run_converter(converter, first: str, model) -> dict[str, torch.Tensor]:
    """``{state-dict name: CPU tensor}`` built by one converter of a ``CheckpointLayout``;
    transformers' own errors propagate."""
    out = converter.convert(first, model=model, config=model.config)
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}
