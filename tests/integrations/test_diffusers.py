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
