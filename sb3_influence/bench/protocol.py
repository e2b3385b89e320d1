"""
The benchmark protocol as data: :data:`ENVS` (the paper's six environments and a smoke test), :data:`SETTINGS`
(optimizer settings), :data:`ARMS` (what filters the records) and :data:`VARIANTS` (options that the authors' code
differs in, for the LunarLander investigation), and how a cell's PPO keyword arguments and result paths follow
from them. Adding an arm, for instance IIF with another score, is one more :class:`Arm` entry in :data:`ARMS`:
no code branches on arm names.
"""

from types import MappingProxyType
import collections
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """
    One benchmark environment with the paper's settings (Hu et al. 2025, Sec. 5).

    :param env_id: Gymnasium id.
    :param fraction: IIF drop fraction ``p`` (rule ``"neg-bottom"``); the random arm drops as many records.
    :param rounds: Number of rounds (rollouts + updates) at ``n_steps * n_envs = 2048`` records per round.
    :param settings: Keys of :data:`SETTINGS` that the protocol runs on this environment, the paper's main
        setting first.
    :param score_range: ``(low, high)`` returns mapped to 0 and 1 for the aggregate statistics (rliable's
        normalised scores): roughly the initial policy's return and a solved policy's return.
    :param env_kwargs: Keyword arguments of ``gym.make``.
    :param register: Module to import before ``gym.make`` (it registers the id), or ``None``.
    :param minigrid: Wrap with ``ImgObsWrapper`` and use the MiniGrid CNN.
    :param exact_eval: Evaluate the stochastic policy exactly (tabular, deterministic env: FrozenLake) instead
        of by sampling episodes.
    :param eval_every: Evaluate every this many rounds (and after the last one).
    :param eval_first: Also evaluate after each of the first this many rounds, for an environment that PPO learns
        within ``eval_every`` rounds (highway-v0: both arms are near their plateau at round 10), where evaluations
        every ``eval_every`` rounds would not see which arm got there first.
    :param resolution: Returns are floored to a multiple of this before computing the speed-up metrics (0: as
        measured). Exact evaluation creeps towards its optimum by ever smaller steps, each of which would be a
        new PPO "level"; 0.01 for FrozenLake gives levels of 1 % success probability.
    :param zoo_kwargs: rl-zoo's PPO hyperparameters for this environment (the ``"sb3"`` setting; rl-zoo's
        ``normalize`` and ``n_timesteps`` are not used), empty when rl-zoo has none.
    """

    env_id: str
    fraction: float
    rounds: int
    settings: tuple[str, ...] = ("sgd",)
    score_range: tuple[float, float] = (0.0, 1.0)
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    register: str | None = None
    minigrid: bool = False
    exact_eval: bool = False
    eval_every: int = 1
    eval_first: int = 0
    resolution: float = 0.0
    zoo_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def evaluated(self, round_: int, rounds: int) -> bool:
        """Whether a run of ``rounds`` rounds evaluates its policy after round ``round_`` (0: the initial one)."""
        return round_ <= self.eval_first or round_ % self.eval_every == 0 or round_ == rounds

    def eval_rounds(self, rounds: int) -> list[int]:
        """The rounds after which a run of ``rounds`` rounds evaluates its policy, round 0 included."""
        return [round_ for round_ in range(rounds + 1) if self.evaluated(round_, rounds)]


_HIGHWAY_CONFIG = MappingProxyType(
    {"observation": {"type": "Kinematics"}, "action": {"type": "DiscreteMetaAction"}, "vehicles_count": 10}
)

# The paper's six environments (Sec. 5) and a smoke test
ENVS: Mapping[str, EnvSpec] = MappingProxyType(
    {
        "FrozenLake": EnvSpec(
            "FrozenLake-v1", 0.5, 50, env_kwargs={"map_name": "4x4", "is_slippery": False}, exact_eval=True, resolution=0.01
        ),
        "Acrobot": EnvSpec(
            "Acrobot-v1",
            0.5,
            50,
            settings=("sgd", "sb3"),
            score_range=(-500.0, -100.0),
            zoo_kwargs=dict(n_envs=16, n_steps=256, gae_lambda=0.94, gamma=0.99, n_epochs=4, ent_coef=0.0),
        ),
        "MiniGrid": EnvSpec(
            "MiniGrid-Empty-8x8-v0", 0.125, 40, settings=("sgd", "adam1e-3", "sb3"), register="minigrid", minigrid=True
        ),
        "highway": EnvSpec(
            "highway-v0",
            0.5,
            100,
            score_range=(0.0, 40.0),
            env_kwargs={"config": _HIGHWAY_CONFIG},
            register="highway_env",
            eval_every=10,
            eval_first=10,
        ),
        "LunarLander": EnvSpec(
            "LunarLander-v3",
            0.125,
            150,
            settings=("sgd", "adam1e-3", "sb3"),
            score_range=(-200.0, 200.0),
            eval_every=3,
            zoo_kwargs=dict(n_envs=16, n_steps=1024, batch_size=64, gae_lambda=0.98, gamma=0.999, n_epochs=4, ent_coef=0.01),
        ),
        "BipedalWalker": EnvSpec(
            "BipedalWalker-v3", 0.0625, 500, settings=("adam3e-4",), score_range=(-100.0, 300.0), eval_every=10
        ),
        # Not in the paper: the trajectory-unit comparison's second environment (DTV-Loo's, arXiv 2609.35072)
        "DoorKey": EnvSpec("MiniGrid-DoorKey-8x8-v0", 0.125, 500, register="minigrid", minigrid=True, eval_every=10),
        # Not in the paper: a few-second smoke test
        "CartPole": EnvSpec("CartPole-v1", 0.5, 2, score_range=(0.0, 500.0)),
    }
)

# The paper's environments, in the paper's order (the smoke test is not part of the protocol)
PAPER_ENVS = ("FrozenLake", "Acrobot", "MiniGrid", "highway", "LunarLander", "BipedalWalker")

# Environments beyond the paper's that the docs page reports (run them with --envs)
EXTRA_ENVS = ("DoorKey",)

# PPO settings shared by every arm and setting (the paper's, Sec. 5; SB3's defaults except ent_coef and clipping)
PPO_KWARGS: Mapping[str, Any] = MappingProxyType(
    dict(
        n_steps=2048,
        batch_size=64,
        n_epochs=10,
        gamma=0.99,
        gae_lambda=0.95,
        clip_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
    )
)


@dataclasses.dataclass(frozen=True)
class OptimizerSetting:
    """
    How PPO optimises: the optimizer, its learning rate, gradient clipping and whether rl-zoo's hyperparameters
    replace :data:`PPO_KWARGS`.

    :param optimizer: ``"sgd"`` or ``"adam"`` (``torch.optim``; Adam with SB3's ``eps=1e-5``).
    :param learning_rate: The learning rate.
    :param max_grad_norm: SB3's gradient clipping; ``1e10`` disables it (as the authors' code does).
    :param zoo: Use the environment's :attr:`EnvSpec.zoo_kwargs` (rl-zoo's tuned values), at the paper's budget
        of environment steps.
    :param description: One line for the docs.
    """

    optimizer: str
    learning_rate: float
    max_grad_norm: float = 1e10
    zoo: bool = False
    description: str = ""


SETTINGS: Mapping[str, OptimizerSetting] = MappingProxyType(
    {
        "sgd": OptimizerSetting("sgd", 5e-3, description="the paper's main setting: SGD, lr 5e-3, no gradient clipping"),
        "adam3e-4": OptimizerSetting(
            "adam", 3e-4, description="the paper's BipedalWalker setting: Adam, lr 3e-4, no clipping"
        ),
        "adam1e-3": OptimizerSetting(
            "adam", 1e-3, description="the paper's Adam results (Table 3): Adam, lr 1e-3, no clipping"
        ),
        "sb3": OptimizerSetting(
            "adam",
            3e-4,
            max_grad_norm=0.5,
            zoo=True,
            description="SB3's defaults (Adam, lr 3e-4, max_grad_norm 0.5) with rl-zoo's hyperparameters where it has them",
        ),
    }
)


@dataclasses.dataclass(frozen=True)
class Arm:
    """
    One arm of the comparison: how a round filter (``IIFCallback`` by default) filters each round (``rule=None``:
    no filtering, plain PPO).

    :param rule: The filter's rule, or ``None``.
    :param label: Name in tables and plots.
    :param color: Matplotlib colour of its curves.
    :param iif_kwargs: Further keyword arguments of the filter (e.g. another ``target``, ``unit``); the drop
        fraction is the environment's ``p``. Recorded in the run's config when not empty.
    :param filter_class: Name of the filter class in ``sb3_influence``, built as ``filter_class(fraction=p, rule=rule,
        **iif_kwargs)``. Recorded in the run's config when not ``"IIFCallback"``.
    :param settings: Keys of :data:`SETTINGS` the arm runs in; ``None``: every setting. The grid, the status table,
        the cost estimates and the statistics of a cell use only the arms that apply to its setting and environment
        (:func:`arms_for`).
    :param envs: Keys of :data:`ENVS` the arm runs in; ``None``: every environment.
    :param versus: Arms it is claimed to beat: the aggregate statistics report ``P(this > other)`` for each, over
        the cells where both apply.
    :param cost: CPU time of one of its runs relative to a run of an arm without scoring overhead of its own (1
        for PPO, IIF and random), for the cost estimates of cells where it has not run yet. Evaluations cost the
        same in every arm, so a training-round ratio is an upper bound.
    :param opt_in: The arm runs only where it is named (``--arms``): a cell is complete without it, and it joins a
        cell's status, results, statistics and plots once it has a finished run there. For arms too costly to be
        part of every cell.
    """

    rule: str | None
    label: str
    color: str = "tab:gray"
    iif_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    filter_class: str = "IIFCallback"
    settings: tuple[str, ...] | None = None
    envs: tuple[str, ...] | None = None
    versus: tuple[str, ...] = ()
    cost: float = 1.0
    opt_in: bool = False

    def applies_to(self, setting: str, env: str | None = None) -> bool:
        """
        Whether the arm runs in the optimizer setting ``setting`` (a key of :data:`SETTINGS`) and, when given, the
        environment ``env`` (a key of :data:`ENVS`).
        """
        return (self.settings is None or setting in self.settings) and (env is None or self.envs is None or env in self.envs)

    def where(self) -> str:
        """Where the arm runs, for error messages."""
        settings = ", ".join(self.settings or SETTINGS)
        return f"settings {settings}" + (f" of {', '.join(self.envs)}" if self.envs is not None else "")


# The optimizer settings whose optimizer is not plain SGD (where an optimizer-aware score can differ from the
# paper's SGD proxy)
_ADAM_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.optimizer != "sgd")

# Add an arm here; nothing else needs to change
ARMS: Mapping[str, Arm] = MappingProxyType(
    {
        "ppo": Arm(None, "PPO", "tab:blue"),
        "iif": Arm("neg-bottom", "IIF", "tab:red", versus=("ppo", "random")),
        "random": Arm("random", "random filter", "tab:gray"),
        # The issues' question: does ranking by the optimizer-aware score instead of the SGD proxy help under Adam?
        "iif-aware": Arm(
            "neg-bottom",
            "IIF (optimizer-aware)",
            "tab:purple",
            iif_kwargs=MappingProxyType({"optimizer_aware": True}),
            settings=_ADAM_SETTINGS,
            versus=("iif", "ppo"),
            cost=2.0,
        ),
        # The score that predicts removals best under Adam (docs/faithfulness.md): does it make a better filter?
        "iif-smoothed": Arm(
            "neg-bottom",
            "IIF (smoothed unrolled)",
            "tab:brown",
            iif_kwargs=MappingProxyType({"optimizer_aware": "unrolled", "clip_smoothing": 3e-2, "n_orders": 4}),
            settings=_ADAM_SETTINGS,
            versus=("iif", "ppo"),
            cost=6.0,
            opt_in=True,
        ),
        # Whole trajectories (issue 13): IIF's score summed per trajectory, and DTV-Loo's consensus score (no
        # target), both budgeted in records, on MiniGrid in the paper's setting (and the smoke test)
        "iif-trajectory": Arm(
            "neg-bottom",
            "IIF per trajectory",
            "tab:orange",
            iif_kwargs=MappingProxyType({"unit": "trajectory", "budget": "records"}),
            settings=("sgd",),
            envs=("MiniGrid", "DoorKey", "CartPole"),
            versus=("ppo", "iif"),
        ),
        "dtv-loo": Arm(
            "neg-bottom",
            "DTV-Loo",
            "tab:green",
            iif_kwargs=MappingProxyType({"budget": "records"}),
            filter_class="DTVLooCallback",
            settings=("sgd",),
            envs=("MiniGrid", "DoorKey", "CartPole"),
            versus=("ppo", "iif"),
            cost=1.5,
        ),
    }
)


def arms_for(setting: str, arms: Sequence[str] | None = None, env: str | None = None) -> tuple[str, ...]:
    """
    The arms that run in an optimizer setting (and environment), in :data:`ARMS` order: every consumer of the grid
    (jobs, status, cost estimates, statistics, plots) asks this.

    :param setting: A key of :data:`SETTINGS`, or a cell name with variants (``"sgd+drop-partial"``).
    :param arms: Only these keys of :data:`ARMS` (default: all but the opt-in ones, ``Arm.opt_in``; in a cell
        with variants, :data:`VARIANT_ARMS`).
    :param env: A key of :data:`ENVS`; ``None``: the arms of the setting in any environment.
    :return: The keys of the arms of ``arms`` that apply to ``setting`` (and ``env``).
    """
    base, *variants = setting.split("+")
    check_names(envs=[env] if env is not None else (), settings=[base], arms=arms or (), variants=variants)
    if arms is not None:
        wanted = set(arms)
    else:
        wanted = set(VARIANT_ARMS) if variants else {name for name, arm in ARMS.items() if not arm.opt_in}
    return tuple(name for name, arm in ARMS.items() if name in wanted and arm.applies_to(base, env))


def check_applies(arm: str, setting: str, env: str | None = None) -> None:
    """Raise ``ValueError`` if ``arm`` does not run in ``setting`` (or ``env``), naming where it runs."""
    check_names(envs=[env] if env is not None else (), settings=[setting], arms=[arm])
    if not ARMS[arm].applies_to(setting, env):
        where = f"setting {setting!r}" + (f" of {env!r}" if env is not None else "")
        raise ValueError(
            f"arm {arm!r} does not apply to {where}: it runs in {ARMS[arm].where()} only (ARMS[{arm!r}].settings, "
            f".envs); choose one of those or another arm"
        )


@dataclasses.dataclass(frozen=True)
class Variant:
    """
    An option of a cell that the authors' code differs in (the LunarLander investigation).

    :param description: One line for the docs.
    :param filtering_only: The option changes nothing for an arm that drops no record, so such an arm's run is
        the same as in the cell without the option and is reused from there when it exists.
    """

    description: str
    filtering_only: bool


def reuses_unfiltered(arm: str, variants: Sequence[str]) -> bool:
    """Whether the run of ``arm`` with ``variants`` is the one without them, bit for bit: the arm drops no record and
    every variant only changes filtering (``Variant.filtering_only``), so it is reused from the cell without them."""
    check_names(arms=[arm], variants=variants)
    return ARMS[arm].rule is None and bool(variants) and all(VARIANTS[v].filtering_only for v in variants)


#: The arms a cell with variants runs by default: the investigation compares IIF's variants with PPO (other arms
#: run there only when named, and then join the cell's page like an opt-in arm)
VARIANT_ARMS = ("ppo", "iif")

VARIANTS: Mapping[str, Variant] = MappingProxyType(
    {
        "drop-partial": Variant(
            "the leftover partial minibatch of the kept records is dropped every round, so a filtering arm takes "
            "n_epochs · floor(n_kept / batch_size) optimizer steps (as a data loader with drop_last)",
            filtering_only=True,
        ),
        "clip0.5": Variant(
            "gradient clipping at max_grad_norm 0.5 (the value the paper lists) instead of none", filtering_only=False
        ),
        "first-unfiltered": Variant(
            "filtering starts at round 2: round 1 is PPO's own update, so the filtered rounds start from the PPO run's "
            "round-1 parameters (the authors ran IIF as a follow-up of a PPO round)",
            filtering_only=True,
        ),
    }
)


def cell_name(setting: str, variants: Sequence[str] = ()) -> str:
    """The directory name of an optimizer setting with variants, e.g. ``"sgd+drop-partial"``."""
    return "+".join([setting, *sorted(variants)])


def result_path(out: str, env: str, setting: str, arm: str, seed: int, variants: Sequence[str] = ()) -> str:
    """Where a run's per-round results go: ``<out>/<env>/<setting>[+variants]/<arm>_seed<seed>.json``."""
    return os.path.join(out, env, cell_name(setting, variants), f"{arm}_seed{seed}.json")


def check_names(
    envs: Sequence[str] = (), settings: Sequence[str] = (), arms: Sequence[str] = (), variants: Sequence[str] = ()
) -> None:
    """Raise ``ValueError`` naming the first unknown env, setting, arm or variant and the valid choices."""
    for kind, names, known in (
        ("env", envs, ENVS),
        ("setting", settings, SETTINGS),
        ("arm", arms, ARMS),
        ("variant", variants, VARIANTS),
    ):
        for name in names:
            if name not in known:
                raise ValueError(f"unknown {kind} {name!r}: choose from {sorted(known)}")


def check_seeds(seeds: Sequence[int]) -> None:
    """
    Raise ``ValueError`` for an empty list of seeds, a seed that is not an int >= 0 (gymnasium refuses the others,
    in the run, after the grid started), or a seed given twice (two runs would write one result file).
    """
    if not seeds:
        raise ValueError("seeds is empty: give at least one seed, e.g. --seeds 0 1 2 3 4")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seeds must be ints >= 0 (gymnasium's seeds), got {seed!r}: e.g. --seeds 0 1 2 3 4")
    repeated = sorted(int(seed) for seed, count in collections.Counter(seeds).items() if count > 1)
    if repeated:
        raise ValueError(f"seeds {repeated} are given twice: each seed is one run per arm, give it once")


def run_kwargs(spec: EnvSpec, setting: str, variants: Sequence[str] = ()) -> dict[str, Any]:
    """
    The ``InfluencePPO`` keyword arguments (and ``rounds``) of a cell: :data:`PPO_KWARGS`, or rl-zoo's values for
    a ``zoo`` setting, then the setting's learning rate and clipping, then the variants.

    :return: Keyword arguments, with ``optimizer`` (a name) and ``rounds`` (the paper's budget of environment steps
        divided by the records per round, rounded up).
    """
    check_names(settings=[setting], variants=variants)
    spec_setting = SETTINGS[setting]
    kwargs: dict[str, Any] = {**PPO_KWARGS, "n_envs": 1}
    if spec_setting.zoo:
        kwargs.update(spec.zoo_kwargs)
    kwargs.update(
        learning_rate=spec_setting.learning_rate, max_grad_norm=spec_setting.max_grad_norm, optimizer=spec_setting.optimizer
    )
    if "clip0.5" in variants:
        kwargs["max_grad_norm"] = 0.5
    budget = spec.rounds * PPO_KWARGS["n_steps"]
    kwargs["rounds"] = math.ceil(budget / (kwargs["n_steps"] * kwargs["n_envs"]))
    return kwargs
