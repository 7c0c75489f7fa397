"""Checks before a compiled generation step: the static cache's room, the token ids and
the learned position table (inside a program a write past the cache would be dropped,
and an out-of-range lookup clamped: wrong tokens, no error). Helpers of
``compile_generate`` (torchjax/integrations/transformers/_generate.py)."""

from __future__ import annotations

import torch

from torchjax.integrations.transformers._cache_state import cache_room
from torchjax.ops.copy import to_cpu
from torchjax.tensor._tensor import JaxTensor

_IDS_READ_WHOLE = 1 << 16  # token ids checked on the host when at most this many


def check_room(model, cache, args, kwargs, lengths):
    """Raise IndexError, as CPU's ``index_copy_`` does, before a step that would write past
    a static layer's ``max_cache_len`` (XLA would drop the write: wrong tokens, no error).
    The length is counted on the host and read from the device when a call writes more
    than one token (a prefill) or when something else wrote the cache since this wrapper's
    last step (a reset for reuse, the decode programs, the caller): ``_write_mark``.
    The call's token ids are checked against the vocabulary then too (a prefill is
    always such a call): inside the program an out-of-range id would be clamped, not
    raised (Note [Device-side checks]).
    Returns ``(decoder, length before the step, length after it)`` for ``record_room`` (and
    ``empty_prefill``), or None."""
    from transformers.cache_utils import EncoderDecoderCache

    new = _new_tokens(args, kwargs)
    decoder = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    limit = cache_room(decoder)
    if new is None or limit is None:
        return None
    known = lengths.get(decoder)
    if known is None or new > 1 or known[1] != _write_mark(decoder):
        known = int(decoder.get_seq_length())
        _check_ids(model, args, kwargs)
    else:
        known = known[0]
    _check_positions(model, kwargs, known + new)
    if known + new > limit:
        raise IndexError(
            f"compile_generate: this step writes cache positions {known}..{known + new - 1} "
            f"but the static cache holds {limit} tokens (its max_cache_len): index {limit} "
            "is out of bounds. Pass a cache with max_cache_len >= prompt length + "
            'max_new_tokens, or let generate build it (cache_implementation="static")'
        )
    return decoder, known, known + new


def position_rows(model) -> int | None:
    """The positions a learned absolute position table holds (GPT-2's ``wpe``, OPT's
    ``embed_positions``: an embedding of ``max_position_embeddings`` rows, or 2 more),
    or None for models without one (rotary ones run past ``max_position_embeddings``)."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    inputs = model.get_input_embeddings()
    for module in model.modules():
        if (
            isinstance(module, torch.nn.Embedding)
            and module is not inputs
            and limit <= module.num_embeddings <= limit + 2
        ):
            return limit
    return None


def _check_positions(model, kwargs, end) -> None:
    """IndexError, as the eager embedding raises, for a step whose position ids reach past
    a learned position table (inside a program the lookup would clamp: wrong tokens). Read
    from the device only for a step whose cache positions reach past it (``end``)."""
    rows = vars(model)["forward"].positions
    if rows is None or end <= rows:
        return
    ids = kwargs.get("position_ids")
    top = end - 1 if not isinstance(ids, torch.Tensor) else int(ids.max())
    if top >= rows:
        raise IndexError(
            f"generate on tpu: position {top} is out of range for the learned position "
            f"embedding with {rows} rows (aten::embedding: index out of range in self); "
            f"the model takes at most {rows} tokens: lower max_new_tokens or the prompt"
        )


def record_room(lengths, room) -> None:
    """After a compiled step: the length ``check_room`` counted, and the cache's mark."""
    if room is not None:
        decoder, _, length = room
        lengths[decoder] = (length, _write_mark(decoder))


def _write_mark(decoder):
    """Identity and write count of the first layer's length tensor (``cumulative_length``;
    its keys when it has none): every change of the cache's length (a step's write-back,
    ``reset()``, the decode programs) moves it, and beam search's reordering does not."""
    for layer in getattr(decoder, "layers", ()):
        for name in ("cumulative_length", "keys"):
            storage = getattr(getattr(layer, name, None), "_storage", None)
            if storage is not None:
                return id(storage), storage.version
    return None


def _check_ids(model, args, kwargs) -> None:
    """IndexError, as the eager embedding raises, for a token id outside the vocabulary."""
    ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if not isinstance(ids, torch.Tensor):
        return
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or ids.numel() == 0:
        return
    if ids.numel() <= _IDS_READ_WHOLE and isinstance(ids, JaxTensor):
        # Read whole (or from its host values, Note [Host values of tensors made from
        # host data]) and checked on the host: no device op, at most one read.
        low, high = torch.stack(torch.aminmax(to_cpu(ids))).tolist()
    else:
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one host read
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise IndexError(
            f"generate on tpu: token id {bad} is out of range for the input embedding "
            f"with {rows} rows (aten::embedding: index out of range in self); pass ids in "
            f"[0, {rows})"
        )


def _new_tokens(args, kwargs) -> int | None:
    """The number of positions this call writes to the (decoder's) cache."""
    names = ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds")
    x = next((kwargs[k] for k in names if isinstance(kwargs.get(k), torch.Tensor)), None)
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    return x.shape[1] if x is not None and x.dim() >= 2 else None
