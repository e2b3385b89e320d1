"""
Targets: the quantity f(θ) whose change an influence score measures (the paper's Sec. 3 defines two: the return
surrogate and the log-probability of chosen actions).

Like kronfluence's ``Task``, the training loss of a record is fixed (the PPO surrogate at the behaviour policy,
``ℓ_i = −Â_i log π(a_i|s_i)``) and the *measurement* is pluggable. A target is any object with a ``name`` and a
``terms(engine, batch_size)`` method yielding scalar tensors whose sum is f(θ), each differentiable with respect
to the policy parameters. The engine gives targets two helpers:

- ``engine.log_prob(observations, actions)``: differentiable ``log π_θ(a|s)`` for a batch (numpy or torch);
- ``engine.buffer_batches(batch_size)``: the current rollout buffer in chunks of
  ``(record_ids, observations, actions, raw_advantages)`` tensors.

A target of the form ``f = Σ_j w_j log π(a_j|s_j)`` over the buffer's own records (like ``ReturnTarget``) may also
define ``buffer_weights(engine) -> np.ndarray`` (flat, by record id): when the buffer fits in one scoring chunk the
engine then computes ``∇f`` and the scores from a single forward pass. ``terms`` must describe the same f.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch as th
from gymnasium import spaces


class ScoringEngine(Protocol):
    """What a target may use of the scoring engine (``sb3_influence.common.scoring.engine.InfluenceEngine``)."""

    policy: Any
    buffer: Any

    def log_prob(self, observations: Any, actions: Any) -> th.Tensor: ...

    def buffer_batches(
        self, batch_size: int, ids: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, Any, th.Tensor, th.Tensor]]: ...


@runtime_checkable
class Target(Protocol):
    """
    The protocol every target implements.

    :ivar name: Short name used for logging and snapshot columns (``influence/<name>/...``).
    """

    name: str

    def terms(self, engine: ScoringEngine, batch_size: int) -> Iterable[th.Tensor]:
        """
        Yield scalar tensors whose sum is f(θ).

        :param engine: The influence engine of the model being scored (gives ``log_prob`` and ``buffer_batches``).
        :param batch_size: The number of samples to put in one forward pass.
        :return: Scalar tensors, each differentiable with respect to the policy parameters.
        """
        ...


@dataclass
class ReturnTarget:
    """
    Return surrogate over the current rollout buffer (the paper's Sec. 3; what IIF uses):
    ``f_return(θ) = (1/n) Σ_j A_j log π_θ(a_j|s_j)`` with raw (un-normalised) GAE advantages.
    Records with a positive score help the agent's return, negative ones hurt it.
    """

    name: str = "return"

    def __hash__(self) -> int:
        # Every ReturnTarget with the same name is the same objective: hashable, so scores can be cached
        return hash((type(self), self.name))

    def terms(self, engine: ScoringEngine, batch_size: int) -> Iterator[th.Tensor]:
        n_records = engine.buffer.n_records
        for _, observations, actions, advantages in engine.buffer_batches(batch_size):
            yield (advantages * engine.log_prob(observations, actions)).sum() / n_records

    def buffer_weights(self, engine: ScoringEngine) -> np.ndarray:
        """``w_j = A_j / n``: f is ``Σ_j w_j log π(a_j|s_j)`` over the buffer's records (lets the engine fuse passes)."""
        return engine.buffer.flat_field("advantages").astype(np.float64) / engine.buffer.n_records


@dataclass(eq=False)
class ActionTarget:
    """
    Behaviour target: ``f_action(θ) = mean over the given pairs (s, a) of log π_θ(a|s)`` (the paper's Sec. 3).
    Positive influence means the record makes these actions more likely in these states.

    :param observations: The states, shape ``(m, *obs_shape)`` (a dict of such arrays for Dict observation
        spaces), in the space the policy sees them (normalised, if ``VecNormalize`` is used). A single
        observation of shape ``obs_shape`` counts as ``m = 1``.
    :param actions: The actions, shape ``(m, *action_shape)``; ``(m,)`` for ``Discrete``.
    :param name: Name used in logs and snapshot columns.
    """

    observations: Any
    actions: Any
    name: str = "action"

    def __post_init__(self) -> None:
        # What can be checked without the model's spaces is checked now; the rest when a model first uses it
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"ActionTarget: name must be a non-empty string (it names log keys and columns), got {self.name!r}"
            )
        values = self.observations.items() if isinstance(self.observations, dict) else [(None, self.observations)]
        for key, value in values:
            _numeric(value, "observations" if key is None else f"observations[{key!r}]")
        if _numeric(self.actions, "actions").size == 0:
            raise ValueError("ActionTarget: `actions` is empty, give at least one (observation, action) pair")

    def check_spaces(self, observation_space: spaces.Space, action_space: spaces.Space) -> None:
        """
        Check the pairs against a model's spaces (what the callbacks call at ``_init_callback``).

        :param observation_space: The policy's observation space.
        :param action_space: The policy's action space.
        """
        self._validated_for(observation_space, action_space)

    def _validated(self, engine: ScoringEngine) -> tuple[Any, np.ndarray]:
        return self._validated_for(engine.policy.observation_space, engine.policy.action_space)

    def _validated_for(self, observation_space: spaces.Space, action_space: spaces.Space) -> tuple[Any, np.ndarray]:
        obs: Any
        if isinstance(observation_space, spaces.Dict):
            if not isinstance(self.observations, dict) or set(self.observations) != set(observation_space.spaces):
                raise ValueError(
                    f"ActionTarget: `observations` must be a dict with keys {sorted(observation_space.spaces)} "
                    f"for a Dict observation space, got {type(self.observations).__name__}"
                )
            obs = {
                key: _with_batch(np.asarray(value), observation_space.spaces[key], "observations", key)
                for key, value in self.observations.items()
            }
            counts = {len(value) for value in obs.values()}
            if len(counts) != 1:
                raise ValueError(
                    f"ActionTarget: every key of `observations` must hold the same number of states, got {counts}"
                )
            n_pairs = counts.pop()
        else:
            obs = _with_batch(np.asarray(self.observations), observation_space, "observations")
            n_pairs = len(obs)
        actions = np.asarray(self.actions)
        if isinstance(action_space, spaces.Discrete):
            actions = actions.reshape(-1) if actions.ndim <= 1 or actions.shape[1:] == (1,) else actions
            expected: tuple[int, ...] = (n_pairs,)
        else:
            shape = tuple(action_space.shape or ())
            actions = actions.reshape(1, *shape) if actions.shape == shape else actions
            expected = (n_pairs, *shape)
        if actions.shape != expected:
            raise ValueError(
                f"ActionTarget: `actions` must have shape {expected} to match {n_pairs} observation(s) and the action "
                f"space {action_space}, got {actions.shape}"
            )
        if n_pairs == 0:
            raise ValueError("ActionTarget: give at least one (observation, action) pair")
        _check_values(actions, action_space, "actions")
        if isinstance(obs, dict):
            for key, value in obs.items():
                _check_values(value, observation_space.spaces[key], f"observations[{key!r}]")  # type: ignore[attr-defined]
        else:
            _check_values(obs, observation_space, "observations")
        return obs, actions

    def terms(self, engine: ScoringEngine, batch_size: int) -> Iterator[th.Tensor]:
        obs, actions = self._validated(engine)
        n_pairs = len(actions)
        for start in range(0, n_pairs, batch_size):
            chunk = slice(start, start + batch_size)
            chunk_obs = {key: value[chunk] for key, value in obs.items()} if isinstance(obs, dict) else obs[chunk]
            yield engine.log_prob(chunk_obs, actions[chunk]).sum() / n_pairs


def _numeric(value: Any, argument: str) -> np.ndarray:
    """``value`` as a numeric array, finite where it is float."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:  # ragged nested lists
        raise ValueError(
            f"ActionTarget: `{argument}` must be an array of numbers, got {type(value).__name__} ({error})"
        ) from error
    if array.dtype.kind not in "biuf":
        raise TypeError(f"ActionTarget: `{argument}` must be an array of numbers, got dtype {array.dtype}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        n_bad = int(np.count_nonzero(~np.isfinite(array)))
        raise ValueError(f"ActionTarget: `{argument}` holds {n_bad} NaN or inf value(s); give finite values")
    return array


def _check_values(values: np.ndarray, space: spaces.Space, argument: str) -> None:
    """Values a discrete space can hold: whole numbers in its range (a float 0.7 is never read as 0)."""
    values = _numeric(values, argument)
    if isinstance(space, spaces.Discrete):
        low, high = np.asarray(space.start), np.asarray(space.start + space.n - 1)
    elif isinstance(space, spaces.MultiDiscrete):
        low, high = np.asarray(space.start), np.asarray(space.start + space.nvec - 1)
    elif isinstance(space, spaces.MultiBinary):
        low, high = np.asarray(0), np.asarray(1)
    else:
        return
    if values.dtype.kind == "f" and not np.array_equal(values, np.round(values)):
        first = values[values != np.round(values)].ravel()[0].item()
        raise ValueError(
            f"ActionTarget: `{argument}` must hold whole numbers for the space {space}, got {first!r}: it would be "
            "truncated to another value. Pass the integer actions (observations) themselves"
        )
    outside = (values < low) | (values > high)
    if outside.any():
        first = values[outside].ravel()[0].item()
        raise ValueError(
            f"ActionTarget: `{argument}` must lie in [{low.min()}, {high.max()}] for the space {space}, "
            f"got {first!r} ({int(np.count_nonzero(outside))} value(s) out of range)"
        )


def check_target(target: "Target", observation_space: spaces.Space, action_space: spaces.Space) -> None:
    """
    Check a target against a model's spaces when it can tell (``check_spaces``); other targets are checked when
    they are scored.

    :param target: The target.
    :param observation_space: The policy's observation space.
    :param action_space: The policy's action space.
    """
    check = getattr(target, "check_spaces", None)
    if callable(check):
        check(observation_space, action_space)


def _with_batch(value: np.ndarray, space: spaces.Space, argument: str, key: str | None = None) -> np.ndarray:
    """Add the batch dimension to a single observation and check the shape against the space."""
    where = f"{argument}[{key!r}]" if key is not None else argument
    shape = () if isinstance(space, spaces.Discrete) else space.shape
    if isinstance(space, spaces.Discrete) and value.ndim == 2 and value.shape[1] == 1:
        # The rollout buffer stores Discrete observations as (n, 1)
        value = value.reshape(-1)
    if value.shape == shape:
        return value[None]
    if value.shape[1:] != shape:
        raise ValueError(
            f"ActionTarget: `{where}` must have shape (m, *{shape}) for the observation space {space}, got {value.shape}"
        )
    return value


def as_target(target: "str | Target") -> "Target":
    """
    Turn what a user passes as ``target`` into a :class:`Target`.

    :param target: ``"return"`` or an object implementing the :class:`Target` protocol.
    :return: The target object.
    """
    if isinstance(target, str):
        if target == "return":
            return ReturnTarget()
        raise ValueError(
            f"Unknown target {target!r}: use 'return', an ActionTarget(observations, actions) "
            "or an object implementing the sb3_influence.Target protocol"
        )
    if not isinstance(target, Target):
        raise TypeError(
            f"target must be 'return' or implement the Target protocol (a `name` and a `terms(engine, batch_size)` "
            f"method), got {type(target).__name__}"
        )
    return target
