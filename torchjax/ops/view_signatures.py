"""How many input signatures a compiled key that reads views inside gets before its
views are read first (the calls whose views lie in a storage that grows every step).

Note [Views in keys whose shapes vary]
A key that reads a view inside is built for the view's layout, and the executable for
the shapes of the other arguments. When those change every call while the layout stays
(``torch.cat([cache, value.transpose(1, 2)])`` of a growing KV cache; ``torch.cat([ids,
next_token[:, None]])`` of ``generate``), each new length compiles a program of the view
read and the op, beside the plain key's program of the same op and shapes (the key cache
without a view): two compiles per step where one would do. So after
``MAX_VIEW_SIGNATURES`` input signatures of such a key, a new signature reads the views
first (one small executable per layout, compiled once) and uses the plain key; the
signatures seen so far keep their fused executables. The read is exact, so the values
are the same. (A 64-token greedy ``generate`` of the tiny Llama: two compiles fewer per
token.) Signatures are counted per key with its views' layouts masked (``layout_masked``:
the view's size kept, its storage numel, strides and offset dropped): the last token of
a batch's growing ids, ``ids[:, -1:]``, has the length as its row stride, so its layout,
and with it the key, is new every step; counted per exact key, every op reading it (the
model's input, the end-of-sequence check, the next position id) compiled its read fused
at every length until ``MAX_VIEW_KEYS``. Views of one storage shape in several layouts
(``w.t()`` and ``w[:, :k]`` of the same size) give one signature, not several: each
keeps its fused executable.

Note [Views of a growing storage]
A view read inside an executable at an offset given as an argument is keyed by its size
and strides alone: the storage's numel is its array's shape, which the input signature
holds, and the stride of a size-1 dimension, which moves no read, is keyed as the
contiguous one (``read_strides``). ``ids[:, -1:]`` of ``generate``'s ids, one longer each
step, is then one key with a new signature per step, so Note [Views in keys whose shapes
vary] applies after two steps: its read is the one program per length that every read of
the last token shares (the model's input, the end-of-sequence check), where a key per
length compiled the op with its read fused, per length, for the first ``MAX_VIEW_KEYS``
lengths.
"""

from __future__ import annotations

from torchjax.ops import fused_nodes
from torchjax.ops.templates import has_view, layout_masked

# Input signatures of one key (its views' layouts masked) that reads a view inside: the
# view's layout is fixed but another argument's shape changes (``cat([cache,
# new_token_view])`` of a growing KV cache), or the view lies in a storage that grows
# (``ids[:, -1:]``): past this many, such calls read their views first and share the
# plain key's executables (Note [Views in keys whose shapes vary]).
MAX_VIEW_SIGNATURES = 2


class ViewSignatures:
    """The input signatures seen per layout-masked key of one overload; ``lock`` is the
    overload's table lock."""

    def __init__(self, lock):
        self.lock = lock
        self.seen: dict = {}

    def varying(self, key, tmpl, kwtmpl, sig) -> bool:
        """Whether a new input signature ``sig`` of ``key`` (which may read views inside)
        should read its views first instead (Note [Views in keys whose shapes vary]);
        counts it among the signatures of the key's layout-masked family."""
        if not (any(has_view(e) for e in tmpl) or any(has_view(e) for _, e in kwtmpl)):
            return False
        family = (
            key[0],
            tuple(layout_masked(e) for e in tmpl),
            tuple((k, layout_masked(e)) for k, e in kwtmpl),
            key[3],
        )
        with self.lock:
            seen = self.seen.get(family, ())
            if sig in seen:
                return False
            if len(seen) >= MAX_VIEW_SIGNATURES:
                return True
            # Note [Captured traces leave the view limits alone] in torchjax/ops/fused_nodes.py
            if fused_nodes.pred() is None:
                self.seen.setdefault(family, set()).add(sig)
            return False
