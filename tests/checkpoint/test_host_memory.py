"""Host memory of saving and loading a tpu model stays near the model's size.

Each figure is measured by bench/host_memory.py in a fresh child process (its module
docstring says how): the peak (VmHWM) and what stays (VmRSS) above the resident memory
just before the operation, as a multiple of the model's bytes. On CPU JAX the model's
"device" arrays are host memory, so a save's rule is on the memory it adds and a load
keeps the model itself (1.0x). The model is a 4-layer Llama of 68M parameters (272 MB in
float32, 136 MB in bfloat16): big enough that a copy of it, or of a quarter of it, is
far above the allowance.

The allowance: 16 MB above the rule, for what a save or load makes besides tensor data
(Python objects, the zip writer's buffers, malloc's arenas); measured, the operations
add less than 4 MB besides their largest tensor (the 33 MB float32 embedding, 0.12x).
"""

import pytest

from bench.host_memory import measure

LAYERS, HIDDEN = 4, 1024
ALLOWANCE = 16e6


def _check(case: str, dtype: str, *, peak: float, kept: float | None = None) -> dict:
    got = measure(case, dtype, LAYERS, HIDDEN)
    slack = ALLOWANCE / got["bytes"]
    assert got["peak"] <= peak + slack, (case, dtype, got)
    if kept is not None:
        assert abs(got["kept"] - kept) <= 0.1 + slack, (case, dtype, got)
    return got


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        ("save_pretrained", "bfloat16"),
        ("save_pretrained sharded", "float32"),
        ("torch.save", "float32"),
        ("torch.save", "bfloat16"),
        ("safetensors", "float32"),
        pytest.param(
            "checkpoint transposed",
            "float32",
            marks=pytest.mark.xfail(
                strict=False,
                reason="each transposed view is made contiguous by an XLA:CPU program whose "
                "freed output glibc keeps in its arenas (live memory is one tensor): "
                "0.21-0.36x measured, higher when another process loads the machine; "
                "malloc_trim returns it",
            ),
        ),
    ],
)
def test_a_save_adds_less_than_a_fifth_of_the_model(case, dtype):
    # Tensors are fetched from the device, written and dropped one at a time (Note
    # [Streaming safetensors writes], Note [Host-backed tpu storages]); before, a save
    # held a host copy of every tensor at once (0.8x to 1.3x the model).
    _check(case, dtype, peak=0.2)


@pytest.mark.parametrize(
    ("case", "dtype"), [("from_pretrained", "bfloat16"), ("from_pretrained tp", "float32")]
)
def test_from_pretrained_keeps_only_the_model(case, dtype):
    # The model itself (device arrays are host memory on CPU JAX) and no host copy of
    # it: read buffers go back to the system (Note [Read buffers go back to the system]).
    # The single-device load kept 1.24x before; the tensor-parallel one (8 simulated
    # devices) read one device's slice at a time already and kept 1.05x: a guard.
    _check(case, dtype, peak=1.2, kept=1.0)
