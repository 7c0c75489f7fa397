"""MoE experts on the ragged-dot kernel, through transformers' experts registry.

transformers (5.x) dispatches the forward of every ``@use_experts_implementation`` experts
module (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) through ``ExpertsInterface`` by
``config._experts_implementation``. :func:`register_experts` adds
``"torchjax_ragged_dot"`` there, so a model selects it with
``from_pretrained(..., experts_implementation="torchjax_ragged_dot")`` or
``model.set_experts_implementation("torchjax_ragged_dot")``.

The forward is transformers' ``grouped_mm`` forward with ``torch.ops.torchjax.ragged_dot``
as the grouped matmul: token-expert pairs sorted by expert, one ragged dot for
gate/up and one for down (expert weights used in their stored layout, no transposed
copy), routing weights applied, order restored, top-k summed in float32. With no more
token-expert pairs than experts (decoding) each pair is multiplied by its own expert's
matrices, gathered, instead (Note [Grouped products of few rows] in
torchjax/ops/matmul.py). Group sizes
are counted with a one-hot sum (no data-dependent shapes), so it also runs under
``torchjax.jit``; pairs routed to experts past ``num_experts`` (expert-parallel
sentinels) fall outside every group and contribute 0.
"""

from __future__ import annotations

import torch

from torchjax import _patches
from torchjax.integrations import _after_import
from torchjax.pallas import ragged_dot

NAME = "torchjax_ragged_dot"


def ragged_dot_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts forward (``ExpertsInterface`` signature).

    Args:
        self: a transformers experts module (``gate_up_proj``/``up_proj``, ``down_proj``
            of shape (E, out, in), or (E, in, out) when ``self.is_transposed``).
        hidden_states: (T, H) tokens.
        top_k_index: (T, k) expert ids; top_k_weights: (T, k) routing weights.

    Returns:
        (T, H) in ``hidden_states``' dtype.
    """
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // num_top_k]
    experts = torch.arange(self.num_experts, device=expert_ids.device)
    group_sizes = (expert_ids[:, None] == experts).sum(dim=0)
    transpose = not self.is_transposed  # (E, out, in) weights: x @ w[e].T
    ids = expert_ids.clamp(max=self.num_experts - 1)

    w_in = self.gate_up_proj if self.has_gate else self.up_proj
    # Decoding, no more pairs than experts: Note [Grouped products of few rows]
    # (torchjax/ops/matmul.py).
    few = expert_ids.shape[0] <= self.num_experts
    valid = (expert_ids < self.num_experts).unsqueeze(-1)

    def product(a, w):
        if few:
            return _by_own_expert(a.to(w.dtype), w, ids, valid, transpose)
        return ragged_dot(a.to(w.dtype), w, group_sizes, transpose)

    h = product(x, w_in)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[ids]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = product(h, self.down_proj)
    if self.has_bias:
        out = out + self.down_proj_bias[ids]
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv_perm = torch.argsort(perm)
    out = out[inv_perm].view(num_tokens, num_top_k, hidden_dim).float().sum(dim=1)
    return out.to(hidden_states.dtype)


def _by_own_expert(x, w, ids, valid, transpose):
    """Row i of ``x`` (M, K) times expert ``ids[i]``'s matrix of ``w``, gathered; rows not
    ``valid`` (expert-parallel sentinels) are 0, as the ragged dot leaves them."""
    w = w[ids]  # (M, N, K) when transpose, else (M, K, N)
    out = torch.bmm(x.unsqueeze(1), w.transpose(1, 2) if transpose else w).squeeze(1)
    return out.masked_fill(~valid, 0)


def register_experts() -> str:
    """Register :func:`ragged_dot_experts_forward` in transformers' ``ExpertsInterface``
    as ``"torchjax_ragged_dot"`` (idempotent) and return that name."""
    from transformers.integrations.moe import ExpertsInterface

    from torchjax._compat.torch_dynamo import dynamo_traced

    # torchjax's files are in Dynamo's skip list (Note [Process-wide changes]), which
    # made this forward a graph break at every MoE layer and refused it under
    # fullgraph=True; it is model code, to be traced as transformers' own experts are.
    ExpertsInterface.register(NAME, dynamo_traced(ragged_dot_experts_forward))
    _patches.record(
        "transformers ExpertsInterface entry",
        why="models select the ragged-dot experts forward by name",
        package="transformers",
        written_for="5.24",
        undo=lambda: ExpertsInterface._global_mapping.pop(NAME, None),
    )
    return NAME


def install_when_imported() -> None:
    """``register_experts()`` now if ``transformers.integrations.moe`` is loaded, else
    right after it is: the name works without a call the user must know to make."""
    _after_import.when_imported(
        "transformers.integrations.moe",
        register_experts,
        why="register the torchjax_ragged_dot experts right after transformers' registry",
    )
