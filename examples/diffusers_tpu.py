"""A tiny Stable Diffusion pipeline on device "tpu": eager, then with a compiled UNet.

No hub is reachable, so every part is built from a config with seeded random weights: a
UNet2DConditionModel, an AutoencoderKL, a CLIP text encoder and a CLIPTokenizer whose
vocabulary (letters, byte-level BPE without merges) is written to a temporary directory,
with a DDIM scheduler. The same pipeline runs two inference steps on CPU, then
``pipe.to("tpu")``, then with ``pipe.unet.compile(backend="tpu", fullgraph=True,
dynamic=False)``, twice. The initial latents are drawn on CPU and passed with
``latents=`` (tpu's random stream differs from CPU's), so all images must agree.

Run:  python examples/diffusers_tpu.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

import torchjax  # noqa: E402  (adds the "tpu" device)

TOLERANCE = 1e-4
STEPS = 2
SIZE = 8  # image height and width, and latents' (a one-block VAE does not downsample)
PROMPT = "a cat on a mat"


def tiny_tokenizer(path: str) -> CLIPTokenizer:
    """A CLIPTokenizer over lowercase letters (one token per letter, ``</w>`` at word
    ends), written as vocab.json/merges.txt under ``path``."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(
        os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"), model_max_length=16
    )


def tiny_pipeline(path: str, seed: int = 0) -> StableDiffusionPipeline:
    """The whole pipeline on CPU, float32, from configs (a few thousand parameters)."""
    tokenizer = tiny_tokenizer(path)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=SIZE, in_channels=4, out_channels=4, block_out_channels=(8,),
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",), cross_attention_dim=16,
        norm_num_groups=4, attention_head_dim=4,
    )  # fmt: skip
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8,), latent_channels=4,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        norm_num_groups=4, sample_size=SIZE,
    )  # fmt: skip
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )  # fmt: skip
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, set_alpha_to_one=False, steps_offset=1,
    )  # fmt: skip
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(seed: int = 0) -> torch.Tensor:
    """Initial noise, drawn on CPU: shape (1, 4, SIZE, SIZE), float32."""
    return torch.randn(1, 4, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def generate(pipe, noise: torch.Tensor) -> np.ndarray:
    """One image, shape (1, SIZE, SIZE, 3), values in [0, 1]."""
    with torch.no_grad():
        return pipe(
            PROMPT, latents=noise.to(pipe.device), num_inference_steps=STEPS,
            guidance_scale=2.0, height=SIZE, width=SIZE, output_type="np",
        ).images  # fmt: skip


def run() -> dict:
    """CPU, tpu eager and tpu compiled images, and the compiled UNet's counters.

    Returns ``{"cpu", "eager", "compiled", "compiled_again"}`` images and ``"stats"``:
    ``torchjax.compile.dynamo_stats()`` increments after the first and the second compiled
    call (graphs captured, jax traces, executable cache hits).
    """
    with tempfile.TemporaryDirectory() as path:
        pipe = tiny_pipeline(path)
    noise = latents()
    out = {"cpu": generate(pipe, noise)}
    pipe.to("tpu")
    out["eager"] = generate(pipe, noise)
    pipe.unet.compile(backend="tpu", fullgraph=True, dynamic=False)
    before = torchjax.compile.dynamo_stats()
    out["compiled"] = generate(pipe, noise)
    mid = torchjax.compile.dynamo_stats()
    out["compiled_again"] = generate(pipe, noise)
    after = torchjax.compile.dynamo_stats()
    out["stats"] = [{k: b[k] - a[k] for k in a} for a, b in ((before, mid), (mid, after))]
    return out


def main() -> int:
    out = run()
    print(f"image {out['cpu'].shape}, {STEPS} DDIM steps")
    ok = True
    for name in ("eager", "compiled", "compiled_again"):
        diff = float(np.abs(out[name] - out["cpu"]).max())
        print(f"tpu {name:15s} max abs difference vs CPU: {diff:.2e}")
        ok &= diff <= TOLERANCE
    first, second = out["stats"]
    print(f"compiled UNet, first call: {first}; second call: {second}")
    if second["graphs"] or second["traces"]:
        print("FAIL: the second call with the same image size recompiled", file=sys.stderr)
        return 1
    if not ok:
        print(f"FAIL: difference exceeds {TOLERANCE}", file=sys.stderr)
        return 1
    print(f"OK: tpu images match CPU within {TOLERANCE}; no recompilation on the second call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
