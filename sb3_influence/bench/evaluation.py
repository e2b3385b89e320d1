"""Evaluation of a benchmark policy: the stochastic policy's mean return, exact or over vectorised episodes."""

from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th

if TYPE_CHECKING:
    from sb3_influence.bench.protocol import EnvSpec


def exact_frozenlake_return(model: Any, env: Any) -> float:
    """
    Expected undiscounted return of the stochastic policy on a deterministic tabular env (FrozenLake,
    ``is_slippery=False``) within its time limit, by dynamic programming over the transition table.

    :param model: The model (discrete observations and actions).
    :param env: One (unwrapped or wrapped) ``FrozenLake`` environment.
    :return: The exact expected return (= success probability).
    """
    base = env.unwrapped
    n_states, n_actions = base.observation_space.n, base.action_space.n
    horizon = env.spec.max_episode_steps if env.spec is not None and env.spec.max_episode_steps else 100
    with th.no_grad():
        obs, _ = model.policy.obs_to_tensor(np.arange(n_states))
        probs = model.policy.get_distribution(obs).distribution.probs.cpu().numpy().astype(np.float64)
    value = np.zeros(n_states)
    for _ in range(horizon):
        new_value = np.zeros(n_states)
        for state in range(n_states):
            for action in range(n_actions):
                for prob, next_state, reward, done in base.P[state][action]:
                    new_value[state] += probs[state, action] * prob * (reward + (0.0 if done else value[next_state]))
        value = new_value
    return float(value[0])


# Evaluation environments stepped together (one batched policy call per step)
EVAL_ENVS = 20


def make_eval_env(spec: "EnvSpec", episodes: int, seed: int) -> Any:
    """
    The evaluation environments of a run: one ``DummyVecEnv`` of ``min(episodes, EVAL_ENVS)`` environments (reseeded
    with ``seed`` before every evaluation), or a single tabular env for exact evaluation.
    """
    from sb3_influence.bench.harness import _plain, make_env

    if spec.exact_eval:
        import gymnasium as gym

        return gym.make(spec.env_id, **_plain(spec.env_kwargs))
    return make_env(spec, min(episodes, EVAL_ENVS), seed)


def evaluate(model: Any, spec: "EnvSpec", episodes: int, seed: int, eval_env: Any = None) -> float:
    """
    Mean return of the stochastic policy: exact for tabular specs, else ``episodes`` episodes on a vector of
    ``min(episodes, EVAL_ENVS)`` environments stepped together (one batched policy call per step), seeded with ``seed``
    at every evaluation. The global torch RNG is restored afterwards, so evaluating does not change the run.

    :param model: The model.
    :param spec: The benchmark.
    :param episodes: Number of evaluation episodes.
    :param seed: Seed of the evaluation envs and action sampling (same across arms: paired evaluation).
    :param eval_env: Environments from :func:`make_eval_env` to reuse (made and closed here if ``None``).
    :return: Mean return.
    """
    from stable_baselines3.common.evaluation import evaluate_policy

    env = make_eval_env(spec, episodes, seed) if eval_env is None else eval_env
    try:
        if spec.exact_eval:
            return exact_frozenlake_return(model, env)
        env.seed(seed)
        with th.random.fork_rng(devices=[]):
            th.manual_seed(seed)
            returns, _ = evaluate_policy(
                model, env, n_eval_episodes=episodes, deterministic=False, warn=False, return_episode_rewards=True
            )
        return float(np.mean(returns))
    finally:
        if eval_env is None:
            env.close()
