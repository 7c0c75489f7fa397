"""``TORCHJAX_COMPILED_EXCESS_PRECISION`` (Note [Excess precision in compiled programs] in
torchjax/ops/xla_options.py): compiled programs take XLA's default, or eager's options with
``0``; a bad value is refused at import. Child processes: the setting is read at import."""

from tests._child import run_python

_PROBE = """
    import jax, torch, torchjax
    from torchjax.ops.xla_options import COMPILED_PROGRAM_OPTIONS
    seen = []
    orig = jax.jit
    def spy(fn, *a, **k):
        if "donate_argnums" in k:  # torchjax.jit's program (per-op executables: no donation)
            seen.append(k.get("compiler_options"))
        return orig(fn, *a, **k)
    jax.jit = spy
    lin = torch.nn.Linear(8, 8).to("tpu", torch.bfloat16)
    x = torch.randn(2, 8).to("tpu", torch.bfloat16)
    with torch.no_grad():
        y = torchjax.jit(lambda x: torch.nn.functional.silu(lin(x)))(x)
    with torch.no_grad():
        assert torch.equal(y.cpu(), torch.nn.functional.silu(lin(x)).cpu())
    print(COMPILED_PROGRAM_OPTIONS, seen[-1])
"""


def test_default_is_xlas():
    proc = run_python(_PROBE, env={"TORCHJAX_COMPILATION_CACHE": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["{}", "None"], proc.stdout  # the program, built


def test_zero_builds_with_eagers_options():
    env = {"TORCHJAX_COMPILATION_CACHE": "0", "TORCHJAX_COMPILED_EXCESS_PRECISION": "0"}
    proc = run_python(_PROBE, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = "{'xla_allow_excess_precision': False} {'xla_allow_excess_precision': False}"
    assert proc.stdout.strip() == want, proc.stdout


def test_a_bad_value_is_refused():
    proc = run_python("import torchjax", env={"TORCHJAX_COMPILED_EXCESS_PRECISION": "no"})
    assert proc.returncode != 0
    assert "ValueError: torchjax: TORCHJAX_COMPILED_EXCESS_PRECISION='no'" in proc.stderr
