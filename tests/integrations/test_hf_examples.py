"""examples/hf_generate.py runs and passes its own checks (diffusers_tpu.py: test_diffusers.py)."""

from examples import hf_generate


def test_hf_generate_example():
    assert hf_generate.main() == 0
