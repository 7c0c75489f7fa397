"""Pallas kernels compiled on a GPU vs the jnp path (the rows of bench/kernels.py).

Run:  python bench/kernels_gpu.py [--quick]

Needs jax with CUDA (``jax[cuda12]``) and a visible GPU; elsewhere it prints why and
exits with status 0 without running anything (interpret-mode figures come from
bench/kernels.py).
"""

from __future__ import annotations

import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench import kernels  # noqa: E402

# Larger than the CPU rows: compiled kernels are cheap to run, and small shapes measure
# launch overhead only. The 8K row is the long-sequence case the tiled kernels are for.
# Every row runs forward and forward + backward (all five kernels); about 20 compiles of
# a few seconds each and 22 runs per row keep the script within a few minutes.
ATTENTION = [(4, 16, 4, 1024, 64, True), (4, 16, 16, 2048, 128, False), (1, 8, 2, 8192, 128, True)]
RAGGED = [(4096, 1024, 2048, 8), (16384, 2048, 1024, 64)]
# Decode steps (forward only) of a 32-query/8-kv-head model: a 32K cache filled to a
# tenth and to half (the kernel's cost follows the filled length, the jnp path's S_max),
# 8 new tokens, and the paged form with 128-position pages.
DECODE = [
    (8, 32, 8, 1, 32768, 128, 0.1, 0),
    (8, 32, 8, 1, 32768, 128, 0.5, 0),
    (8, 32, 8, 8, 8192, 128, 0.5, 0),
    (8, 32, 8, 1, 8192, 128, 0.5, 128),
]


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as error:  # jax raises RuntimeError for an unknown backend
        gpus, why = [], str(error).splitlines()[0]
    else:
        why = "jax sees no GPU device"
    if not gpus:
        print(
            f"bench/kernels_gpu.py: no GPU available to jax ({why}); nothing run. "
            "Install jax with CUDA support on a GPU machine, or run bench/kernels.py "
            "for the interpret-mode rows on CPU."
        )
        return 0
    quick = "--quick" in argv
    runs = 5 if quick else 20
    rows = []
    with jax.default_device(gpus[0]):
        for grad in (False, True):
            rows += kernels.attention_rows(
                kernels.ATTENTION_QUICK if quick else ATTENTION, runs, interpret=False, grad=grad
            )
            rows += kernels.ragged_rows(
                kernels.RAGGED_QUICK if quick else RAGGED, runs, interpret=False, grad=grad
            )
        rows += kernels.decode_rows(
            kernels.DECODE_QUICK if quick else DECODE, runs, interpret=False
        )
    kernels.print_table(f"Pallas kernels on {gpus[0].device_kind}", rows, "Pallas (compiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
