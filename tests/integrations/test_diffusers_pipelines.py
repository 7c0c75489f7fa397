"""diffusers pipelines on "tpu": SD3, Flux, QwenImage, Wan and LTX-2, eager and with a
compiled transformer, each against the same pipeline on CPU.

Each pipeline is built tiny (tests/integrations/tiny_pipelines.py) and runs two steps
with the initial noise drawn from a CPU generator seeded alike. Then
``pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)`` runs it twice:
both calls equal CPU, and the second captures and traces nothing (every transformer call
is a hit of the first call's executables).
"""

import numpy as np
import pytest
import torch

import torchjax
from tests.integrations.tiny_pipelines import PIPELINES

# float32 through a few steps; measured differences are at most a few 1e-6.
TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _generator():
    # Note [CPU generators on tpu]: diffusers draws the noise on the generator's device.
    return torch.Generator().manual_seed(0)


def _assert_matches(got: dict, want: dict) -> int:
    """Compares every output array; returns how many values were compared."""
    assert got.keys() == want.keys()
    compared = 0
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name], w, rtol=0, atol=TOLERANCE, err_msg=name)
        compared += w.size
    return compared


def _compiled_call(case, pipe):
    before = torchjax.compile.dynamo_stats()
    out = case.call(pipe, _generator())
    after = torchjax.compile.dynamo_stats()
    return out, {k: after[k] - before[k] for k in before}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_on_tpu_matches_cpu_eager_and_compiled(name):
    case = PIPELINES[name]
    pipe = case.build()
    pipe.set_progress_bar_config(disable=True)
    cpu = case.call(pipe, _generator())
    # Something to compare: non-empty, finite outputs that are not one constant.
    assert cpu and all(v.size and np.isfinite(v).all() and v.std() > 0 for v in cpu.values())

    pipe.to("tpu")
    assert pipe.transformer.device.type == "tpu"
    assert _assert_matches(case.call(pipe, _generator()), cpu) > 0

    pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)
    first, first_stats = _compiled_call(case, pipe)
    second, second_stats = _compiled_call(case, pipe)
    _assert_matches(first, cpu)
    _assert_matches(second, cpu)
    assert first_stats["graphs"] == first_stats["traces"] == case.graphs
    assert first_stats["cache_hits"] == case.calls - case.graphs
    assert second_stats == {"graphs": 0, "traces": 0, "cache_hits": case.calls}


def test_sd3_scheduler_steps_compile_only_their_arithmetic():
    # FlowMatchEulerDiscreteScheduler finds its step with ``(timesteps == t).nonzero()``
    # at the first step: run on the host (Note [nonzero on the host]), it compiles no
    # program, where op by op it compiled ~17. What the steps compile is the update's
    # arithmetic (eq, sub, mul, add), in the first call only.
    case = PIPELINES["sd3"]
    pipe = case.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.to("tpu")
    made, step = [], pipe.scheduler.step

    def counted(*args, **kwargs):
        before = torchjax.stats()["compiles"]
        out = step(*args, **kwargs)
        made.append(torchjax.stats()["compiles"] - before)
        return out

    pipe.scheduler.step = counted
    case.call(pipe, _generator())
    case.call(pipe, _generator())
    assert len(made) == 2 * case.calls
    assert sum(made[: case.calls]) <= 5, made
    assert made[1:] == [0] * (len(made) - 1), made
