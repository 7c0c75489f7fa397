"""torchjax.mesh / get_mesh (torchjax/device/_mesh.py); cases in _cases.py."""


def test_mesh_context_nesting_and_decorator(check):
    check("mesh_context_nesting_and_decorator")


def test_mesh_one_device_is_noop(check):
    check("mesh_one_device_is_noop")
