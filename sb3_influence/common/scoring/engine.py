"""
The scoring engine: influence of every rollout record on a target, without per-record gradients.

For a record i with training loss ``ℓ_i = −Â_i log π(a_i|s_i)`` (the PPO surrogate at the behaviour policy, where
the ratio is 1 and the clip inactive) and a target f, the paper's local influence (Sec. 3) is::

    I_i = −⟨∇θ ℓ_i, ∇θ f⟩ = Â_i · ⟨∇θ log π(a_i|s_i), v⟩,    v = ∇θ f.

So the engine computes one target gradient ``v`` and then the *alignment* ``D_i = ⟨∇θ log π_i, v⟩`` of every
record, in chunks:

- layers handled by a :class:`~sb3_influence.common.scoring.layers.LayerScorer` (``Linear``, ``Conv1d/2d/3d`` by
  default): the ghost dot product. A forward hook keeps the layer input ``x_i``; the gradient ``g_i`` of
  ``Σ_i log π_i`` with respect to the layer output is record i's own (records do not interact in eval mode).
  A layer called several times adds one term per call.
- Every other parameter (``log_std``, layer norms, embeddings, ...): one forward-mode pass, ``torch.func.jvp``
  of the per-record log-probabilities in the direction of ``v`` restricted to those parameters, which is
  exactly ``D_i`` for them.

``method="jvp"`` sends every parameter down the forward-mode path; it is the cross-check of the ghost path.
Memory is O(chunk · layer width): no ``[n, G, F]`` tensor is ever built. Scoring runs in eval mode and with no
hooks left behind, never touches ``.grad`` or the optimizer, and restores ``policy.training``.
"""

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.preprocessing import preprocess_obs
from torch import nn

from sb3_influence.common import sb3_compat
from sb3_influence.common.scoring.layers import DEFAULT_LAYER_SCORERS, LayerScorer
from sb3_influence.common.targets import Target

if TYPE_CHECKING:
    from sb3_influence.common.buffers import InfluenceRolloutBufferMixin

ENGINE_MODES = ("ghost", "jvp")

Batch = tuple[np.ndarray, Any, th.Tensor, th.Tensor]


class _ActorLogProb(nn.Module):
    """``forward(obs, actions) = log π(a|s)``: the actor path of an ``ActorCriticPolicy`` as a module."""

    def __init__(self, engine: "InfluenceEngine"):
        super().__init__()
        self.policy = engine.policy
        # Kept out of the module tree: the engine is not a module
        self.__dict__["_engine"] = engine

    def forward(self, observations: Any, actions: th.Tensor, action_masks: th.Tensor | None = None) -> th.Tensor:
        engine: InfluenceEngine = self.__dict__["_engine"]
        return engine._log_prob_tensors(observations, actions, action_masks)


class InfluenceEngine:
    """
    Scores the records of a model's rollout buffer. Built by ``InfluencePPO._setup_model``; users call
    ``model.compute_influence`` rather than the engine.

    :param policy: The actor-critic policy whose ``log π`` is differentiated.
    :param buffer: The rollout buffer whose records are scored.
    :param method: ``"ghost"`` (layer scorers where they apply, forward-mode for the rest) or ``"jvp"``
        (forward-mode for every parameter).
    :param layer_scorers: The per-layer ghost scorers, tried in order (default: Linear and convolutions).
    """

    def __init__(
        self,
        policy: ActorCriticPolicy,
        buffer: "InfluenceRolloutBufferMixin",
        method: str = "ghost",
        layer_scorers: "tuple[LayerScorer, ...] | None" = None,
    ):
        if method not in ENGINE_MODES:
            raise ValueError(f"influence_method must be one of {ENGINE_MODES}, got {method!r}")
        self.policy = policy
        self.buffer = buffer
        self.method = method
        self.layer_scorers = DEFAULT_LAYER_SCORERS if layer_scorers is None else tuple(layer_scorers)
        for scorer in self.layer_scorers:
            if not isinstance(scorer, LayerScorer):
                raise TypeError(
                    f"influence_layer_scorers: {scorer!r} does not implement the LayerScorer protocol "
                    "(methods handles(module) and dot(module, inputs, grad_out, v_weight, v_bias))"
                )
        self._actor = _ActorLogProb(self)

    def layer_scorer(self, module: nn.Module) -> LayerScorer | None:
        """The first layer scorer that handles ``module`` (``None``: forward mode scores its parameters)."""
        for scorer in self.layer_scorers:
            if scorer.handles(module):
                return scorer
        return None

    # ------------------------------------------------------------------ log-probabilities
    @property
    def dtype(self) -> th.dtype:
        return next(self.policy.parameters()).dtype

    @property
    def device(self) -> th.device:
        return self.policy.device

    def _to_tensor(self, value: Any) -> th.Tensor:
        return value.to(self.device) if isinstance(value, th.Tensor) else th.as_tensor(np.asarray(value), device=self.device)

    def log_prob(self, observations: Any, actions: Any, action_masks: Any = None) -> th.Tensor:
        """
        Differentiable ``log π_θ(a|s)`` for a batch of observations (numpy or torch, dict for Dict spaces).

        :param observations: Observations as the policy sees them, with a leading batch dimension.
        :param actions: Actions with the same leading dimension.
        :param action_masks: Invalid-action masks applied to the distribution as sb3-contrib's maskable policies
            apply them (``None``: unmasked); for the buffer's own records, :meth:`action_masks` gives them.
        :return: Tensor of shape ``(batch,)``.
        """
        if isinstance(observations, dict):
            observations = {key: self._to_tensor(value) for key, value in observations.items()}
        else:
            observations = self._to_tensor(observations)
        masks = None if action_masks is None else self._to_tensor(action_masks)
        return self._actor(observations, self._to_tensor(actions), masks)

    def action_masks(self, ids: np.ndarray) -> th.Tensor | None:
        """
        The action masks the buffer stores for the records ``ids`` (the hook of masked policies: the buffer's
        ``record_action_masks``), ``None`` when its records carry none.

        :param ids: Flat record ids.
        :return: Tensor of shape ``(len(ids), mask_dims)`` on the model's device, or ``None``.
        """
        masks = self.buffer.record_action_masks(np.asarray(ids))
        return None if masks is None else self._to_tensor(masks)

    def _log_prob_tensors(self, observations: Any, actions: th.Tensor, action_masks: th.Tensor | None = None) -> th.Tensor:
        policy = self.policy
        preprocessed = preprocess_obs(observations, policy.observation_space, normalize_images=policy.normalize_images)
        # SB3's preprocessing casts to float32; follow the policy's dtype (float64 in the exactness tests)
        if isinstance(preprocessed, dict):
            preprocessed = {key: value.to(self.dtype) for key, value in preprocessed.items()}
        else:
            preprocessed = preprocessed.to(self.dtype)
        features = policy.pi_features_extractor(preprocessed)
        latent_pi = policy.mlp_extractor.forward_actor(features)
        distribution = sb3_compat.action_distribution(policy, latent_pi)
        if action_masks is not None:
            # Exactly as MaskableActorCriticPolicy.evaluate_actions: masked logits set to a constant, renormalised
            distribution.apply_masking(action_masks)  # type: ignore[attr-defined]
        if isinstance(policy.action_space, spaces.Discrete):
            actions = actions.long().flatten()
        else:
            actions = actions.to(self.dtype)
        return distribution.log_prob(actions)

    def buffer_batches(self, batch_size: int, ids: np.ndarray | None = None) -> Generator[Batch, None, None]:
        """
        The current rollout buffer in record-id order (or the records ``ids``, in that order), in chunks.

        :param batch_size: Records per chunk.
        :param ids: Flat record ids to restrict to; every record when None.
        :return: Tuples ``(record_ids, observations, actions, raw_advantages)``, tensors on the model's device.
        """
        buffer = self.buffer
        if not buffer.full:
            raise RuntimeError("No rollout to score: the rollout buffer is empty. Collect a rollout first (learn()).")
        observations = buffer.flat_field("observations")
        actions = buffer.flat_field("actions")
        advantages = buffer.flat_field("advantages")
        all_ids = np.arange(buffer.n_records) if ids is None else np.asarray(ids)
        for start in range(0, len(all_ids), batch_size):
            chunk_ids = all_ids[start : start + batch_size]
            obs: Any
            if isinstance(observations, dict):
                obs = {key: self._to_tensor(value[chunk_ids]) for key, value in observations.items()}
            else:
                obs = self._to_tensor(observations[chunk_ids])
            yield (
                chunk_ids,
                obs,
                self._to_tensor(actions[chunk_ids].astype(np.float32, copy=False)),
                self._to_tensor(advantages[chunk_ids]).to(self.dtype),
            )

    # ------------------------------------------------------------------ scoring
    def target_gradient(self, target: Target, batch_size: int) -> dict[str, th.Tensor]:
        """
        ``∇θ f`` for the parameters ``log π`` depends on (those that receive a gradient).

        :param target: The target f.
        :param batch_size: Samples per forward pass.
        :return: Parameter name → gradient; parameters f does not depend on are left out.
        """
        names, params = zip(*[(name, p) for name, p in self.policy.named_parameters() if p.requires_grad], strict=True)
        total: list[th.Tensor | None] = [None] * len(params)
        n_terms = 0
        for term in target.terms(self, batch_size):
            n_terms += 1
            grads = th.autograd.grad(term, params, allow_unused=True)
            total = [acc if g is None else (g if acc is None else acc + g) for acc, g in zip(total, grads, strict=True)]
        if n_terms == 0:
            raise ValueError(f"Target {target.name!r} yielded no terms: it defines no objective")
        return {name: g.detach() for name, g in zip(names, total, strict=True) if g is not None}

    @contextmanager
    def _capture(self, modules: list[nn.Module]) -> Iterator[list[tuple[nn.Module, th.Tensor, th.Tensor]]]:
        calls: list[tuple[nn.Module, th.Tensor, th.Tensor]] = []

        def hook(module: nn.Module, inputs: tuple[th.Tensor, ...], output: th.Tensor) -> None:
            calls.append((module, inputs[0].detach(), output))

        handles = [module.register_forward_hook(hook) for module in modules]
        try:
            yield calls
        finally:
            for handle in handles:
                handle.remove()

    def _plan(
        self, v: dict[str, th.Tensor]
    ) -> tuple[dict[nn.Module, tuple[th.Tensor | None, th.Tensor | None]], dict[str, th.Tensor]]:
        """Split ``v`` into the layers scored by ghost dot products and the parameters left to forward mode."""
        named = dict(self.policy.named_parameters())
        name_of = {id(param): name for name, param in named.items()}
        ghost: dict[nn.Module, tuple[th.Tensor | None, th.Tensor | None]] = {}
        covered: set[int] = set()
        if self.method == "ghost":
            for module in self.policy.modules():
                if self.layer_scorer(module) is None:
                    continue
                v_w = v.get(name_of.get(id(module.weight), ""))
                bias = getattr(module, "bias", None)
                v_b = v.get(name_of.get(id(bias), "")) if bias is not None else None
                if v_w is None and v_b is None:
                    continue
                ghost[module] = (v_w, v_b)
                covered.add(id(module.weight))
                if bias is not None:
                    covered.add(id(bias))
        rest = {name: v[name] for name in v if id(named[name]) not in covered}
        return ghost, rest

    def _chunk_alignment(
        self,
        plan: tuple[dict[nn.Module, tuple[th.Tensor | None, th.Tensor | None]], dict[str, th.Tensor]],
        obs: Any,
        actions: th.Tensor,
        action_masks: th.Tensor | None = None,
    ) -> th.Tensor:
        """``D_i`` for one chunk; ``action_masks`` are the chunk's records' masks (masked policies)."""
        ghost, rest = plan
        chunk = th.zeros(len(actions), dtype=self.dtype, device=self.device)
        if ghost:
            with self._capture(list(ghost)) as calls:
                log_prob = self._actor(obs, actions, action_masks)
            grads = th.autograd.grad(log_prob.sum(), [output for _, _, output in calls], allow_unused=True)
            for (module, inputs, _), grad_out in zip(calls, grads, strict=True):
                if grad_out is not None:
                    scorer = self.layer_scorer(module)
                    assert scorer is not None
                    chunk = chunk + scorer.dot(module, inputs, grad_out, *ghost[module])
        if rest:
            chunk = chunk + self._jvp(rest, obs, actions, action_masks)
        return chunk.detach()

    def alignment(self, v: dict[str, th.Tensor], batch_size: int, ids: np.ndarray | None = None) -> np.ndarray:
        """
        ``D_i = ⟨∇θ log π(a_i|s_i), v⟩`` for every record of the buffer (or only the records ``ids``).

        :param v: A direction in parameter space (usually a target gradient), by parameter name.
        :param batch_size: Records per chunk.
        :param ids: Flat record ids to score; every record when None.
        :return: Flat float64 array indexed by record id (zero outside ``ids``).
        """
        plan = self._plan(v)
        scores = np.zeros(self.buffer.n_records, dtype=np.float64)
        for chunk_ids, obs, actions, _ in self.buffer_batches(batch_size, ids):
            masks = self.action_masks(chunk_ids)
            scores[chunk_ids] = self._chunk_alignment(plan, obs, actions, action_masks=masks).cpu().double().numpy()
        return scores

    def _fused_alignment(self, weights: np.ndarray, batch_size: int) -> np.ndarray:
        """
        ``∇f`` and ``D`` from one forward and one backward pass, for a target ``f = Σ_j w_j log π(a_j|s_j)`` over the
        buffer's own records when the whole buffer fits in one chunk (the common IIF case).

        The backward of ``f`` to the parameters also passes through every layer output, where record j's gradient is
        ``w_j g_j`` (records do not interact): the ghost dot products of those scaled gradients are ``w_j D_j``, so
        one backward gives both ``∇f`` and ``D`` — divided by ``w_j``. Records whose weight is zero or too small for
        the division to be exact (``|w_j| < 2⁻²⁰ max|w|``, or below the fourth root of the dtype's smallest normal
        number, where ``w_j g_j`` may underflow) are scored again by
        the unscaled path, so every ``D_j`` is exact.
        """
        ids, obs, actions, _ = next(self.buffer_batches(self.buffer.n_records))
        masks = self.action_masks(ids)
        with self._capture([module for module in self.policy.modules() if self.layer_scorer(module) is not None]) as calls:
            log_prob = self._actor(obs, actions, masks)
        names, params = zip(*[(name, p) for name, p in self.policy.named_parameters() if p.requires_grad], strict=True)
        w = th.as_tensor(weights, device=self.device).to(self.dtype)
        # Layers whose output needs no gradient (frozen, or before every trainable parameter) have nothing to score
        calls = [call for call in calls if call[2].requires_grad]
        outputs = [output for _, _, output in calls]
        grads = th.autograd.grad((w * log_prob).sum(), [*params, *outputs], allow_unused=True)
        v = {name: g.detach() for name, g in zip(names, grads[: len(params)], strict=True) if g is not None}
        if not v:
            return np.zeros(self.buffer.n_records)
        ghost, rest = self._plan(v)
        scaled = th.zeros(len(ids), dtype=self.dtype, device=self.device)
        for (module, inputs, _), grad_out in zip(calls, grads[len(params) :], strict=True):
            if grad_out is not None and module in ghost:
                scorer = self.layer_scorer(module)
                assert scorer is not None
                scaled = scaled + scorer.dot(module, inputs, grad_out, *ghost[module])
        # Exact division needs w_j g_j far from underflow: a floor relative to the largest weight, and an absolute one
        floor = max(float(w.abs().max()) * 2.0**-20, th.finfo(self.dtype).tiny ** 0.25)
        exact = w.abs() >= floor
        alignment = th.where(exact, scaled / th.where(exact, w, th.ones_like(w)), th.zeros_like(w))
        if rest:
            alignment = alignment + self._jvp(rest, obs, actions, masks)
        scores = alignment.detach().cpu().double().numpy()
        redo = ids[~exact.cpu().numpy()]
        if len(redo):
            scores[redo] = self.alignment(v, batch_size, ids=redo)[redo]
        return scores

    def _jvp(self, v: dict[str, th.Tensor], obs: Any, actions: th.Tensor, action_masks: th.Tensor | None = None) -> th.Tensor:
        names = list(v)
        named = dict(self.policy.named_parameters())
        primals = tuple(named[name].detach() for name in names)
        tangents = tuple(v[name] for name in names)

        def log_prob(*values: th.Tensor) -> th.Tensor:
            params = {f"policy.{name}": value for name, value in zip(names, values, strict=True)}
            # One name per parameter and no weight tying: a shared features extractor is reachable under several
            # names, and with tie_weights=True functional_call leaves the tied parameters swapped out afterwards
            return th.func.functional_call(self._actor, params, (obs, actions, action_masks), tie_weights=False)

        with th.no_grad():
            outputs = th.func.jvp(log_prob, primals, tangents)
        return outputs[1]

    def influence(self, target: Target, advantages: np.ndarray, batch_size: int) -> np.ndarray:
        """
        ``I_i = −⟨∇ℓ_i, ∇f⟩ = Â_i · D_i`` for every record (the paper's Sec. 3).

        :param target: The target f.
        :param advantages: ``Â_i`` as the coming update will see them, flat, indexed by record id.
        :param batch_size: Records per chunk.
        :return: Flat float64 array indexed by record id.
        """
        advantages = np.asarray(advantages, dtype=np.float64)
        with self.eval_mode():
            buffer_weights = getattr(target, "buffer_weights", None)
            if buffer_weights is not None and self.method == "ghost" and self.buffer.n_records <= batch_size:
                return advantages * self._fused_alignment(np.asarray(buffer_weights(self)), batch_size)
            v = self.target_gradient(target, batch_size)
            if not v:
                return np.zeros(self.buffer.n_records)
            return advantages * self.alignment(v, batch_size)

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        """
        Score in eval mode (records must not interact, e.g. through batch norm); afterwards restore the mode and
        the action distribution's state (SB3 distributions keep their last parameters, which would otherwise hold
        the scoring graph and make the model impossible to deepcopy).
        """
        was_training = self.policy.training
        distribution_state = dict(vars(self.policy.action_dist))
        self.policy.set_training_mode(False)
        try:
            yield
        finally:
            self.policy.set_training_mode(was_training)
            vars(self.policy.action_dist).update(distribution_state)
