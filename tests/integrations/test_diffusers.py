"""A tiny diffusers StableDiffusionPipeline on "tpu", eager and with a compiled UNet.

Runs examples/diffusers_tpu.py (its ``run()``: the pipeline built from configs, CPU
latents passed with ``latents=``) and checks what its ``main()`` prints.
"""

import numpy as np

from examples import diffusers_tpu


def test_diffusers_pipeline_eager_and_compiled_unet_match_cpu():
    out = diffusers_tpu.run()
    cpu = out["cpu"]
    assert cpu.shape == (1, diffusers_tpu.SIZE, diffusers_tpu.SIZE, 3)
    for name in ("eager", "compiled", "compiled_again"):
        np.testing.assert_allclose(out[name], cpu, rtol=0, atol=diffusers_tpu.TOLERANCE)
    first, second = out["stats"]
    # pipe.unet.compile(backend="tpu", fullgraph=True): one graph, traced once, its
    # executable reused for the other 2 steps; the second pipeline call with the same
    # image size captures and traces nothing new.
    assert first == {"graphs": 1, "traces": 1, "cache_hits": diffusers_tpu.STEPS - 1}
    assert second == {"graphs": 0, "traces": 0, "cache_hits": diffusers_tpu.STEPS}


def test_pipeline_with_a_cpu_generator_is_reproducible_and_matches_cpu():
    # generator= seeds the initial latents (diffusers' randn_tensor draws on the
    # generator's device, then moves) and, with eta > 0, DDIM's per-step noise.
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as path:
        pipe = diffusers_tpu.tiny_pipeline(path)

    def generate():
        with torch.no_grad():
            return pipe(
                diffusers_tpu.PROMPT, generator=torch.Generator().manual_seed(0), eta=1.0,
                num_inference_steps=diffusers_tpu.STEPS, guidance_scale=2.0,
                height=diffusers_tpu.SIZE, width=diffusers_tpu.SIZE, output_type="np",
            ).images  # fmt: skip

    cpu = generate()
    pipe.to("tpu")
    first, second = generate(), generate()
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, cpu, rtol=0, atol=diffusers_tpu.TOLERANCE)
