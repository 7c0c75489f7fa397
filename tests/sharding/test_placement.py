"""shard / shard_ / constraint / sharding_of (torchjax/sharding/_placement.py)."""


def test_shard_eager_ops_and_cpu_gather(check):
    check("shard_eager_ops_and_cpu_gather")


def test_shard_autograd_and_inplace_param(check):
    check("shard_autograd_and_inplace_param")


def test_constraint_inside_jit(check):
    check("constraint_inside_jit")


def test_dp_fsdp_jit_train_step(check):
    check("dp_fsdp_jit_train_step")


def test_writes_keep_the_placement(check):
    check("writes_keep_the_placement")


def test_jit_adamw_step_mixed_placement(check):
    losses = check("jit_adamw_step_mixed_placement")
    assert len(losses) == 2


def test_jit_input_off_the_mesh_names_it(check):
    msg = check("jit_input_off_the_mesh_names_it")
    assert len(msg) < 600, msg
    assert "parameter 'bias'" in msg and "devices [5]" in msg, msg
    assert "{'tp': 2} (devices [0, 1])" in msg and "shard_(t, P())" in msg, msg
