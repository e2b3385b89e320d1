"""Shared fixtures: tiny environments of every space, rollout collection and a brute-force influence reference."""

import importlib.util

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.preprocessing import preprocess_obs
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from sb3_influence.common import sb3_compat
from sb3_influence.extras import EXTRA_MODULES


def requires(*modules: str, extra: str) -> pytest.MarkDecorator:
    """
    Skip a test where one of ``modules`` is not installed, naming the extra that installs it: the suite passes with
    the core requirements alone (the README's test command installs every extra, so nothing is skipped in CI).

    :param modules: Top-level modules the test imports.
    :param extra: The extra that installs them (checked against ``sb3_influence.extras.EXTRA_MODULES``).
    :return: The ``skipif`` mark.
    """
    unlisted = set(modules) - set(EXTRA_MODULES[extra])
    assert not unlisted, f"EXTRA_MODULES[{extra!r}] does not list {sorted(unlisted)}"
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} not installed: install the {extra} extra, pip install -e '.[{extra}]'"
    )


class SpaceEnv(gym.Env):
    """Random observations of any space, reward depending on the action, episodes of ``ep_length`` steps."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space, ep_length: int = 20):
        super().__init__()
        self.observation_space = observation_space
        self.action_space = action_space
        self.ep_length = ep_length
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
            self.action_space.seed(seed)
        self._t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self._t += 1
        reward = float(np.tanh(np.sum(np.asarray(action, dtype=np.float64))) + 0.1 * self.np_random.normal())
        return self.observation_space.sample(), reward, self._t >= self.ep_length, False, {}


class TinyCNN(BaseFeaturesExtractor):
    """Two small convolutions (one without bias, one strided and padded) and a linear layer."""

    def __init__(self, observation_space: spaces.Box, features_dim: int = 8):
        super().__init__(observation_space, features_dim)
        channels = observation_space.shape[0]
        self.cnn = th.nn.Sequential(
            th.nn.Conv2d(channels, 4, kernel_size=3, bias=False),
            th.nn.ReLU(),
            th.nn.Conv2d(4, 4, kernel_size=3, stride=2, padding=1),
            th.nn.Tanh(),
            th.nn.Flatten(),
        )
        with th.no_grad():
            n_flat = self.cnn(th.zeros(1, *observation_space.shape)).shape[1]
        self.linear = th.nn.Sequential(th.nn.Linear(n_flat, features_dim), th.nn.ReLU())

    def forward(self, observations: th.Tensor) -> th.Tensor:
        return self.linear(self.cnn(observations))


class OddExtractor(BaseFeaturesExtractor):
    """Layers off the beaten track: grouped circular Conv1d, LayerNorm (forward-mode path), a Linear used twice."""

    def __init__(self, observation_space: spaces.Box, features_dim: int = 8):
        super().__init__(observation_space, features_dim)
        channels, length = observation_space.shape
        self.conv = th.nn.Conv1d(channels, 4, kernel_size=3, padding=1, padding_mode="circular", groups=2)
        self.norm = th.nn.LayerNorm(4 * length)
        self.down = th.nn.Linear(4 * length, features_dim)
        self.shared = th.nn.Linear(features_dim, features_dim)

    def forward(self, observations: th.Tensor) -> th.Tensor:
        hidden = self.norm(th.tanh(self.conv(observations)).flatten(1))
        hidden = th.tanh(self.shared(th.tanh(self.down(hidden))))
        return th.tanh(self.shared(hidden))


IMAGE_SPACE = spaces.Box(0, 255, (3, 8, 8), dtype=np.uint8)
VECTOR_SPACE = spaces.Box(-1.0, 1.0, (3,), dtype=np.float32)
ACTION_SPACES = {
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
    "multibinary": spaces.MultiBinary(3),
}
OBSERVATION_SPACES = {
    "box": VECTOR_SPACE,
    "discrete": spaces.Discrete(5),
    "dict": spaces.Dict({"vec": VECTOR_SPACE, "pos": spaces.Discrete(4)}),
    "image": IMAGE_SPACE,
    "sequence": spaces.Box(-1.0, 1.0, (2, 8), dtype=np.float32),
}


def make_env(obs: str = "box", action: str = "discrete", ep_length: int = 20) -> SpaceEnv:
    return SpaceEnv(OBSERVATION_SPACES[obs], ACTION_SPACES[action], ep_length=ep_length)


def policy_for(obs: str) -> tuple[str, dict]:
    if obs == "dict":
        return "MultiInputPolicy", dict(net_arch=[8])
    if obs == "image":
        return "CnnPolicy", dict(features_extractor_class=TinyCNN, net_arch=[8])
    if obs == "sequence":
        return "MlpPolicy", dict(features_extractor_class=OddExtractor, net_arch=[8])
    return "MlpPolicy", dict(net_arch=[8, 8])


def collect_rollout(model) -> None:
    """Collect one rollout (and its advantages) without training."""
    sb3_compat.collect_rollout(model)


def params_equal(a, b) -> bool:
    return all(th.equal(p, q) for p, q in zip(a.policy.parameters(), b.policy.parameters(), strict=True))


# ---------------------------------------------------------------------- brute force reference (independent of the engine)
def reference_log_prob(policy, obs, actions) -> th.Tensor:
    """log π(a|s) through SB3's own modules, in the policy's dtype."""
    dtype = next(policy.parameters()).dtype
    pre = preprocess_obs(obs, policy.observation_space, normalize_images=policy.normalize_images)
    pre = {k: v.to(dtype) for k, v in pre.items()} if isinstance(pre, dict) else pre.to(dtype)
    latent = policy.mlp_extractor.forward_actor(policy.pi_features_extractor(pre))
    dist = sb3_compat.action_distribution(policy, latent)
    if isinstance(policy.action_space, spaces.Discrete):
        actions = actions.long().flatten()
    else:
        actions = actions.to(dtype)
    return dist.log_prob(actions)


def reference_training_advantages(model) -> np.ndarray:
    """Â_i: normalised per first-epoch minibatch (numpy, float64), or raw."""
    buffer = model.rollout_buffer
    raw = buffer.flat_field("advantages").astype(np.float64)
    if not model.normalize_advantage:
        return raw
    out = raw.copy()
    perm = buffer.first_epoch_permutation()
    for start in range(0, len(perm), model.batch_size):
        ids = perm[start : start + model.batch_size]
        if len(ids) > 1:
            out[ids] = (raw[ids] - raw[ids].mean()) / (raw[ids].std(ddof=1) + 1e-8)
    return out


def buffer_tensors(model):
    buffer = model.rollout_buffer
    obs = buffer.flat_field("observations")
    obs = {k: th.as_tensor(v) for k, v in obs.items()} if isinstance(obs, dict) else th.as_tensor(obs)
    actions = th.as_tensor(buffer.flat_field("actions").astype(np.float32))
    return obs, actions


def index_obs(obs, i):
    return {k: v[i : i + 1] for k, v in obs.items()} if isinstance(obs, dict) else obs[i : i + 1]


def reference_influence(model, target_fn, advantages=None) -> np.ndarray:
    """I_i = −⟨∇ℓ_i, ∇f⟩ from one autograd call per record (flat, indexed by record id)."""
    policy = model.policy
    params = [p for p in policy.parameters() if p.requires_grad]
    obs, actions = buffer_tensors(model)
    if advantages is None:
        advantages = reference_training_advantages(model)
    adv = th.as_tensor(advantages).to(next(policy.parameters()).dtype)

    def flat_grad(value):
        grads = th.autograd.grad(value, params, allow_unused=True)
        return th.cat([(th.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)])

    v = flat_grad(target_fn(policy, obs, actions))
    scores = []
    for i in range(model.rollout_buffer.n_records):
        loss_i = -(adv[i] * reference_log_prob(policy, index_obs(obs, i), actions[i : i + 1])).sum()
        scores.append(-(flat_grad(loss_i) @ v).item())
    return np.array(scores)


def reference_return_target(model):
    raw = th.as_tensor(model.rollout_buffer.flat_field("advantages").astype(np.float64))

    def target(policy, obs, actions):
        log_prob = reference_log_prob(policy, obs, actions)
        return (raw.to(log_prob.dtype) * log_prob).mean()

    return target


# ---------------------------------------------------------------------- masked envs and per-record gradients
class MaskedSpaceEnv(SpaceEnv):
    """``SpaceEnv`` with random invalid-action masks (at least one valid choice per sub-action), for MaskablePPO."""

    def _draw_mask(self) -> None:
        space = self.action_space
        sizes = (
            [int(space.n)]
            if isinstance(space, spaces.Discrete)
            else list(space.nvec)
            if isinstance(space, spaces.MultiDiscrete)
            else [2] * int(space.n)
        )
        parts = []
        for size in sizes:
            part = self.np_random.random(size) < 0.6
            part[self.np_random.integers(size)] = True
            parts.append(part)
        self._mask = np.concatenate(parts)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        self._draw_mask()
        return obs, info

    def step(self, action):
        result = super().step(action)
        self._draw_mask()
        return result

    def action_masks(self) -> np.ndarray:
        return self._mask


def make_masked_env(obs: str = "box", action: str = "discrete", ep_length: int = 20) -> MaskedSpaceEnv:
    return MaskedSpaceEnv(OBSERVATION_SPACES[obs], ACTION_SPACES[action], ep_length=ep_length)


def reference_masked_log_prob(policy, obs, actions, masks=None) -> th.Tensor:
    """log π(a|s) through SB3's modules, masked as sb3-contrib's MaskableActorCriticPolicy masks it."""
    dtype = next(policy.parameters()).dtype
    pre = preprocess_obs(obs, policy.observation_space, normalize_images=policy.normalize_images)
    pre = {k: v.to(dtype) for k, v in pre.items()} if isinstance(pre, dict) else pre.to(dtype)
    latent = policy.mlp_extractor.forward_actor(policy.pi_features_extractor(pre))
    dist = sb3_compat.action_distribution(policy, latent)
    if masks is not None:
        dist.apply_masking(masks)
    if isinstance(policy.action_space, spaces.Discrete):
        actions = actions.long().flatten()
    else:
        actions = actions.to(dtype)
    return dist.log_prob(actions)


def reference_log_prob_grads(model, use_masks: bool = True) -> th.Tensor:
    """Row i: ∇θ log π(a_i|s_i) of record i (flat by record id), one autograd call per record, with its stored mask."""
    policy = model.policy
    params = [p for p in policy.parameters() if p.requires_grad]
    obs, actions = buffer_tensors(model)
    buffer = model.rollout_buffer
    masks = getattr(buffer, "action_masks", None)
    if masks is not None and use_masks:
        masks = th.as_tensor(masks if buffer.generator_ready else buffer.to_flat(masks))
    else:
        masks = None
    rows = []
    for i in range(buffer.n_records):
        mask = None if masks is None else masks[i : i + 1]
        log_prob = reference_masked_log_prob(policy, index_obs(obs, i), actions[i : i + 1], mask).sum()
        grads = th.autograd.grad(log_prob, params, allow_unused=True)
        rows.append(th.cat([(th.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]))
    return th.stack(rows).detach()


@pytest.fixture(autouse=True)
def _single_thread():
    # Two pytest workers on two cores: one thread each
    th.set_num_threads(1)
