"""The explicit decomposition list (torchjax/ops/decompositions.py) against the
installed torch: an upgrade that adds or drops a decomposition fails here, by name.
Then the nn.functional long tail that runs through decompositions (or composite kernels)
onto ops lowered elsewhere, checked against CPU: an OpInfo sweep, and for the random ops
(the dropout family), whose values cannot match CPU's generator, shapes and rates."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax._compat.torch import OpOverload, decomposition_table
from torchjax.ops import decompositions, registry

# Higher-order operators in the table (out_dtype) never reach the op table.
OPS = [
    "nn.functional.unfold",
    "nn.functional.pixel_shuffle",
    "nn.functional.pixel_unshuffle",
    "nn.functional.channel_shuffle",
    "nn.functional.one_hot",
    "nn.functional.normalize",
    "nn.functional.local_response_norm",
    "nn.functional.prelu",
    "nn.functional.cosine_similarity",
    "nn.functional.pairwise_distance",
    "nn.functional.softmin",
    "nn.functional.softmin.with_dtype",
]
globals().update(make_tests(OPS))

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


_G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "fn,p",
    [
        (lambda x: F.dropout(x, 0.3, training=True), 0.3),
        (lambda x: F.dropout2d(x, 0.4, training=True), 0.4),
        (lambda x: F.dropout3d(x[..., None], 0.4, training=True)[..., 0], 0.4),
        (lambda x: F.alpha_dropout(x, 0.3, training=True), 0.3),
        (lambda x: F.feature_alpha_dropout(x, 0.3, training=True), 0.3),
    ],
)
def test_dropout_family_shapes_and_rates(fn, p):
    x = torch.randn(64, 32, 8, 8, generator=_G)
    torch.manual_seed(0)
    out = fn(x.to("tpu"))
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "tpu"
    want = fn(x)

    # Dropped entries all take one value (0, or alpha dropout's a'): its frequency is p.
    # Kept ones are transformed as on CPU, so mean and spread match CPU's closely.
    def dropped_fraction(t):
        return t.unique(return_counts=True)[1].max().item() / t.numel()

    got = out.cpu()
    assert abs(dropped_fraction(got) - p) < 0.03
    assert abs(dropped_fraction(want) - p) < 0.03
    torch.testing.assert_close(got.mean(), want.mean(), atol=0.05, rtol=0)
    torch.testing.assert_close(got.std(), want.std(), atol=0.05, rtol=0)
