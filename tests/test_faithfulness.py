"""The faithfulness (LDS) measurement on a tiny round: sane where first order is exact, and side-effect free."""

import numpy as np
import pytest
import torch as th
from conftest import collect_rollout

from sb3_influence import InfluencePPO
from sb3_influence.analysis.faithfulness import faithfulness, retrained_target


def one_step_sgd_model() -> InfluencePPO:
    # One full-batch SGD step with a small learning rate: the first-order prediction is (nearly) exact
    model = InfluencePPO(
        "MlpPolicy",
        "CartPole-v1",
        n_steps=64,
        batch_size=64,
        n_epochs=1,
        learning_rate=1e-3,
        max_grad_norm=1e10,
        seed=0,
        policy_kwargs=dict(net_arch=[16], optimizer_class=th.optim.SGD),
    )
    collect_rollout(model)
    return model


def test_lds_is_high_where_first_order_is_exact_and_the_model_is_untouched():
    model = one_step_sgd_model()
    scores = {"single": model.compute_influence(), "aware": model.compute_influence(optimizer_aware=True)}
    scores["shuffled"] = np.random.default_rng(0).permutation(scores["single"].ravel()).reshape(scores["single"].shape)
    before = [p.detach().clone() for p in model.policy.parameters()]
    rng_before = np.random.get_state()[1].copy()
    result = faithfulness(model, scores, sizes=(0.1, 0.3), n_subsets=12, n_orders=2)
    assert all(th.equal(p, q) for p, q in zip(before, model.policy.parameters(), strict=True))
    np.testing.assert_array_equal(np.random.get_state()[1], rng_before)
    # A single full-batch step does not depend on the order: the truth is perfectly reliable
    assert result["reliability"] == pytest.approx(1.0)
    assert result["lds"]["single"] > 0.95 and result["lds"]["aware"] > 0.95
    assert abs(result["lds"]["shuffled"]) < 0.6
    assert result["extremes"]["aware"]["bottom"] > 0 > result["extremes"]["aware"]["top"]
    # reference + subsets + random 5 % drops + bottom/top of 3 scores, each under 2 orders
    assert result["n_retrains"] == 2 * (1 + 2 * 12 + 5 + 3 * 2)


def test_retraining_without_nothing_is_the_update():
    model = one_step_sgd_model()
    value = retrained_target(model, np.zeros(model.rollout_buffer.keep.shape, dtype=bool), order_seed=0)
    model.train()
    from sb3_influence.analysis.intervention import target_value

    assert value == pytest.approx(target_value(model), rel=1e-6)


def test_bad_arguments():
    model = one_step_sgd_model()
    with pytest.raises(ValueError, match="n_orders"):
        faithfulness(model, {"single": model.compute_influence()}, n_orders=1)
    with pytest.raises(ValueError, match="n_subsets"):
        faithfulness(model, {"single": model.compute_influence()}, n_subsets=2)
