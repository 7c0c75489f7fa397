"""examples/mix_jax_torch.py runs and passes its own checks."""


def test_mix_jax_torch_example():
    from examples import mix_jax_torch

    assert mix_jax_torch.main() == 0


def test_flax_interop_example():
    from examples import flax_interop

    assert flax_interop.main() == 0
