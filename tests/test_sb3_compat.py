"""The SB3 adapter: every private SB3 name the package uses must still exist in the installed SB3."""

import inspect

import pytest
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import RolloutBuffer

from sb3_influence import InfluencePPO
from sb3_influence.common import sb3_compat


@pytest.mark.parametrize("owner, name", sb3_compat.PRIVATE_NAMES, ids=lambda x: getattr(x, "__name__", x))
def test_private_sb3_methods_exist(owner, name):
    assert callable(getattr(owner, name, None)), (
        f"stable_baselines3 {owner.__module__}.{owner.__name__}.{name} is gone or renamed: update "
        "sb3_influence/common/sb3_compat.py (the only module that uses it)"
    )


def test_private_sb3_attributes_exist():
    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1)
    model.learn(16)
    for name in sb3_compat.PRIVATE_ATTRIBUTES:
        assert name in vars(model), f"SB3 no longer sets {name} on algorithms: update sb3_influence/common/sb3_compat.py"


def test_signatures_the_adapter_calls():
    assert list(inspect.signature(RolloutBuffer._get_samples).parameters)[:2] == ["self", "batch_inds"]
    update = inspect.signature(BaseAlgorithm._update_current_progress_remaining)
    assert list(update.parameters) == ["self", "num_timesteps", "total_timesteps"]
    setup = inspect.signature(BaseAlgorithm._setup_learn)
    assert list(setup.parameters)[:6] == [
        "self",
        "total_timesteps",
        "callback",
        "reset_num_timesteps",
        "tb_log_name",
        "progress_bar",
    ]


def test_no_other_module_uses_a_private_sb3_name():
    """
    Private SB3 names (from the adapter's list) appear only in the adapter: in the package, its tests, benchmarks and
    scripts. The one exception is the override of ``_setup_learn`` (SB3 expects subclasses to extend it), which calls
    ``super()._setup_learn``.
    """
    import pathlib
    import re

    import sb3_influence

    names = {name for _, name in sb3_compat.PRIVATE_NAMES} | set(sb3_compat.PRIVATE_ATTRIBUTES)
    root = pathlib.Path(sb3_influence.__file__).parent.parent
    files = [
        path
        for folder in ("sb3_influence", "tests", "benchmarks", "scripts")
        for path in (root / folder).rglob("*.py")
        if path.name not in ("sb3_compat.py", "test_sb3_compat.py")
    ]
    assert len(files) > 20, f"expected the package, tests and benchmarks under {root}, found {len(files)} files"

    def pattern(name: str) -> str:
        exempt = r"(?<!super\(\))" if name == "_setup_learn" else ""
        return exempt + r"\." + re.escape(name) + r"\b"

    offenders = [
        f"{path.relative_to(root)}: {name}" for path in files for name in names if re.search(pattern(name), path.read_text())
    ]
    assert not offenders, offenders
