"""parallelize with HF tp_plans, and a user's tp_plan at load time (torchjax/sharding/_plan.py)."""


def test_parallelize_plan_dict_styles_and_constraints(check):
    check("parallelize_plan_dict_styles_and_constraints")


def test_plan_matching_follows_transformers(check):
    check("plan_matching_follows_transformers")


def test_uneven_dims_replicate_with_warning(check):
    check("uneven_dims_replicate_with_warning")


def test_parallelize_cpu_model_keeps_ties(check):
    check("parallelize_cpu_model_keeps_ties")


def test_styles_are_transformers_vocabulary():
    # Note [Which plan applies]: the styles torchjax accepts are transformers' (the order
    # of its registry depends on which of its modules was imported first; _ACCEPTED keeps
    # the one from_pretrained sees), and those it does not place are the rest.
    import transformers.modeling_utils  # noqa: F401  (registers the styles)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    from torchjax.sharding import _plan

    assert sorted(_plan._ACCEPTED) == sorted(ALL_PARALLEL_STYLES)
    assert set(_plan._ACCEPTED) - set(_plan._UNPLACED) == _plan.STYLES


def test_tp_plan_dict_overrides_the_models_plan(check):
    check("tp_plan_dict_overrides_the_models_plan")


def test_tp_plan_refusals_are_transformers(check):
    check("tp_plan_refusals_are_transformers")


def test_tp_plan_rules_naming_nothing_warn_as_transformers(check):
    check("tp_plan_rules_naming_nothing_warn_as_transformers")


def test_empty_tp_plan_applies_no_rule(check):
    check("empty_tp_plan_applies_no_rule")
