"""The explicit decomposition list (torchjax/ops/decompositions.py) against the
installed torch: an upgrade that adds or drops a decomposition fails here, by name."""

import torch

import torchjax  # noqa: F401
from torchjax._compat.torch import OpOverload, decomposition_table
from torchjax.ops import decompositions, registry

# Higher-order operators in the table (out_dtype) never reach the op table.
TABLE = {str(op): op for op in decomposition_table if isinstance(op, OpOverload)}


def _handled_otherwise(op) -> bool:
    # A lowering, or (in-place and out= overloads) the functional sibling's handler.
    return registry.has_lowering(op) or registry.runs_sibling(op)


def test_every_listed_decomposition_is_in_torchs_table():
    assert len(decompositions.LISTED) > 150
    removed = sorted(decompositions.LISTED - TABLE.keys())
    assert removed == [], f"torch no longer decomposes these; lower them or drop them: {removed}"


def test_every_decomposition_torch_has_is_listed_or_lowered():
    added = sorted(
        name
        for name, op in TABLE.items()
        if name not in decompositions.LISTED and not _handled_otherwise(op)
    )
    assert added == [], f"torch decomposes these now; list them or lower them: {added}"


def test_no_listed_op_is_handled_otherwise():
    # A lowering (or a functional sibling) wins over the decomposition: a dead line.
    dead = sorted(name for name in decompositions.LISTED if _handled_otherwise(TABLE[name]))
    assert dead == []


def test_a_listed_op_resolves_to_torchs_decomposition():
    op = torch.ops.aten.addr.default
    assert str(op) in decompositions.LISTED
    assert decompositions.get(op) is decomposition_table[op]
    a, b, c = torch.randn(2, 3), torch.randn(2), torch.randn(3)
    got = torch.addr(a.to("tpu"), b.to("tpu"), c.to("tpu"), beta=0.5, alpha=2)
    torch.testing.assert_close(got.cpu(), torch.addr(a, b, c, beta=0.5, alpha=2))


def test_an_unlisted_op_gets_no_decomposition():
    op = torch.ops.aten.addcmul.default  # lowered, and in torch's table
    assert op in decomposition_table and str(op) not in decompositions.LISTED
    assert decompositions.get(op) is None and not decompositions.has(op)
