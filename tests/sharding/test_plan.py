"""parallelize with HF tp_plans (torchjax/sharding/_plan.py)."""


def test_parallelize_plan_dict_styles_and_constraints(check):
    check("parallelize_plan_dict_styles_and_constraints")


def test_plan_matching_follows_transformers(check):
    check("plan_matching_follows_transformers")


def test_uneven_dims_replicate_with_warning(check):
    check("uneven_dims_replicate_with_warning")


def test_parallelize_cpu_model_keeps_ties(check):
    check("parallelize_cpu_model_keeps_ties")
