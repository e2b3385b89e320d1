"""
Temporal analysis of behaviour formation (the paper's Sec. 4.2).

Score every round with an ``ActionTarget`` for one behaviour (``AttributionCallback(targets=[...])`` writes the
scores into the snapshots) and follow the records that drive it. The paper sees three phases: action-advantage
association, then semantic clustering (helpful records sit in similar states: low *graph roughness*), then
saturation (scores near 0). :func:`behaviour_formation` computes one row of metrics per round,
:func:`graph_roughness` is the clustering metric and :func:`plot_phases` draws the phase plot.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th

from sb3_influence.common.snapshots import load_all
from sb3_influence.common.stats import spearman
from sb3_influence.extras import import_optional

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from sb3_influence.influence_ppo import InfluencePPO


def graph_roughness(
    scores: np.ndarray,
    embeddings: np.ndarray,
    n_neighbors: int = 20,
    sigma: float | None = None,
    positive_only: bool = True,
) -> float:
    """
    Graph roughness of influence scores over a state graph (the paper's Sec. 4.2):
    ``Σ_{i<j} w_ij (Ĩ_i - Ĩ_j)² / Σ_{i<j} w_ij`` with ``Ĩ = I / ‖I‖∞`` and Gaussian weights
    ``w_ij = exp(-‖e_i - e_j‖² / σ²)`` kept only between ``u`` nearest neighbours (an edge exists when either end
    is among the other's ``n_neighbors`` nearest). Low values: similar states get similar scores (clustering).

    :param scores: Influence scores, shape ``(n,)`` (any shape, flattened).
    :param embeddings: State embeddings of the same records, shape ``(n, d)`` (or ``(n,)``).
    :param n_neighbors: ``u``, neighbours per record (20-100 in the paper).
    :param sigma: Kernel width; ``None``: the median heuristic (median distance between the kept records).
    :param positive_only: Keep only records with positive influence, as in the paper.
    :return: The roughness in ``[0, 4]``; ``nan`` when fewer than two records remain or every score is 0.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    embeddings = np.asarray(embeddings, dtype=np.float64)
    embeddings = embeddings.reshape(len(embeddings), -1)
    if len(embeddings) != len(scores):
        raise ValueError(
            f"embeddings has {len(embeddings)} rows but scores has {len(scores)} records; give one embedding per record"
        )
    if isinstance(n_neighbors, bool) or not isinstance(n_neighbors, (int, np.integer)) or n_neighbors < 1:
        raise ValueError(f"n_neighbors must be a positive int, got {n_neighbors!r}")
    if sigma is not None and not sigma > 0:
        raise ValueError(f"sigma must be positive or None (median heuristic), got {sigma!r}")
    if positive_only:
        mask = scores > 0
        scores, embeddings = scores[mask], embeddings[mask]
    n = len(scores)
    scale = np.abs(scores).max() if n else 0.0
    if n < 2 or scale == 0:
        return float("nan")
    normalised = scores / scale
    squared = np.square(embeddings).sum(1)
    distances2 = np.maximum(squared[:, None] + squared[None, :] - 2.0 * embeddings @ embeddings.T, 0.0)
    np.fill_diagonal(distances2, 0.0)
    if sigma is None:
        upper = distances2[np.triu_indices(n, k=1)]
        median = float(np.median(np.sqrt(upper)))
        sigma = median if median > 0 else 1.0
    weights = np.exp(-distances2 / sigma**2)
    # u nearest neighbours (the record itself excluded), symmetrised
    u = min(int(n_neighbors), n - 1)
    ranked = distances2 + np.diag(np.full(n, np.inf))
    neighbours = np.argpartition(ranked, u - 1, axis=1)[:, :u]
    adjacency = np.zeros((n, n), dtype=bool)
    adjacency[np.repeat(np.arange(n), u), neighbours.reshape(-1)] = True
    adjacency |= adjacency.T
    weights = np.where(adjacency, weights, 0.0)
    upper_i, upper_j = np.triu_indices(n, k=1)
    w = weights[upper_i, upper_j]
    total = w.sum()
    if total == 0:
        return float("nan")
    return float((w * (normalised[upper_i] - normalised[upper_j]) ** 2).sum() / total)


def state_embeddings(model: "InfluencePPO", observations: Any, kind: str = "latent_pi") -> np.ndarray:
    """
    Embeddings of states for :func:`graph_roughness`.

    :param model: The model whose policy embeds the states (its current parameters).
    :param observations: A batch of observations as the policy sees them (dict for Dict spaces).
    :param kind: ``"latent_pi"``: the actor's latent features (features extractor + actor MLP);
        ``"features"``: the features extractor's output; ``"obs"``: the preprocessed observation, flattened.
    :return: Array of shape ``(batch, d)``.
    """
    from stable_baselines3.common.preprocessing import preprocess_obs

    if kind not in ("latent_pi", "features", "obs"):
        raise ValueError(f"kind must be 'latent_pi', 'features' or 'obs', got {kind!r}")
    policy = model.policy
    was_training = policy.training
    policy.set_training_mode(False)
    try:
        obs, _ = policy.obs_to_tensor(observations)
        with th.no_grad():
            if kind == "obs":
                preprocessed = preprocess_obs(obs, policy.observation_space, normalize_images=policy.normalize_images)
                if isinstance(preprocessed, dict):
                    out = th.cat([preprocessed[k].flatten(1).float() for k in sorted(preprocessed)], dim=1)
                else:
                    out = preprocessed.flatten(1).float()
            else:
                features = policy.pi_features_extractor(
                    preprocess_obs(obs, policy.observation_space, normalize_images=policy.normalize_images)
                )
                out = policy.mlp_extractor.forward_actor(features) if kind == "latent_pi" else features
    finally:
        policy.set_training_mode(was_training)
    return out.cpu().numpy().astype(np.float64).reshape(out.shape[0], -1)


def behaviour_formation(
    snapshots: Any,
    target: str = "action",
    embed: Callable[[np.ndarray], np.ndarray] | None = None,
    n_neighbors: int = 20,
    top_fraction: float = 0.1,
    action: int | None = None,
) -> "pd.DataFrame":
    """
    Per-round metrics of how the records drive one behaviour (the paper's Sec. 4.2).

    :param snapshots: A directory of snapshots, a file, or a list of snapshots (paths, ``load_snapshot`` results
        or dicts of arrays) scored with the behaviour's ``ActionTarget``.
    :param target: Name of that target in the snapshots (``ActionTarget(..., name=...)``).
    :param embed: Maps the records' observations, flattened to ``(n_records, features)`` floats, to state
        embeddings; default: the flattened observations themselves. For FrozenLake, coordinates work well:
        ``lambda obs: np.stack([obs[:, 0] // 4, obs[:, 0] % 4], axis=1)``. To embed every round in the same
        space, as the paper does, use the final model's features:
        ``lambda obs: state_embeddings(final_model, obs.reshape(-1, *final_model.observation_space.shape))``.
    :param n_neighbors: Neighbours per record in :func:`graph_roughness`.
    :param top_fraction: Share of records counted as "top" for ``top_advantage``.
    :param action: The behaviour's action (``Discrete`` spaces), or ``None``. When given, adds the column
        ``action_association``: the Spearman correlation of influence with the advantage signed by the action,
        ``Â_i`` for records that took ``action`` and ``-Â_i`` for the others (the paper's action-advantage
        association: a record raises ``log π(action|s)`` when it reinforces that action or discourages another).
    :return: DataFrame, one row per round: ``round``, ``num_timesteps``, ``association`` (Spearman correlation of
        influence with the training advantage: phase 1), ``roughness`` (graph roughness of the positive records:
        phase 2 when low), ``scale`` (max ``|I|``: phase 3 when near 0), ``positive_fraction``, ``top_advantage``
        (mean training advantage of the top records), and ``action_association`` when ``action`` is given.
    """
    import pandas as pd

    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction!r}")
    if action is not None and (isinstance(action, bool) or not isinstance(action, (int, np.integer))):
        raise TypeError(f"action must be a Discrete action (an int) or None, got {action!r}")
    rows = []
    for snapshot in load_all(snapshots):
        scores = snapshot.scores(target)
        advantage_key = "training_advantage" if "training_advantage" in snapshot.arrays else "advantage"
        advantages = snapshot.flat(advantage_key).astype(np.float64)
        states = snapshot.observations()
        embeddings = states if embed is None else np.asarray(embed(states), dtype=np.float64)
        n_top = max(1, round(top_fraction * scores.size))
        top = np.argsort(scores)[::-1][:n_top]
        row = {}
        if action is not None:
            taken = snapshot.flat("action").reshape(scores.size, -1)
            if taken.shape[1] != 1:
                raise ValueError(
                    f"action={action!r} needs Discrete actions, but the records hold actions of shape {taken.shape[1:]}"
                )
            row["action_association"] = spearman(scores, np.where(taken[:, 0] == action, advantages, -advantages))
        rows.append(
            {
                "round": snapshot.round,
                "num_timesteps": snapshot.num_timesteps,
                "association": spearman(scores, advantages),
                "roughness": graph_roughness(scores, embeddings, n_neighbors=n_neighbors),
                "scale": float(np.abs(scores).max()) if scores.size else float("nan"),
                "positive_fraction": float((scores > 0).mean()),
                "top_advantage": float(advantages[top].mean()),
                **row,
            }
        )
    return pd.DataFrame(rows)


def plot_phases(formation: "pd.DataFrame", title: str | None = None) -> "Figure":
    """
    The phase plot: association, roughness and scale of the behaviour's influence across rounds.

    :param formation: What :func:`behaviour_formation` returns.
    :param title: Figure title.
    :return: A matplotlib figure (three panels sharing the round axis).
    """
    missing = {"round", "association", "roughness", "scale"} - set(formation.columns)
    if missing:
        raise ValueError(f"formation lacks the columns {sorted(missing)}: pass what behaviour_formation() returns")
    matplotlib_figure = import_optional("matplotlib.figure", "analysis", "plot_phases()")
    figure = matplotlib_figure.Figure(figsize=(9, 2.8), layout="constrained")
    axes = figure.subplots(1, 3, sharex=True)
    panels = (
        ("association", "association\nSpearman(I, Â)"),
        ("roughness", "graph roughness\n(positive records)"),
        ("scale", "scale\nmax |I|"),
    )
    for ax, (column, label) in zip(axes, panels, strict=True):
        ax.plot(formation["round"], formation[column], marker="o")
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    return figure
