"""
Which optional extra of sb3_influence installs which module: the one-line "module not installed" error of every
command line entry point (``sb3-influence``, ``sb3-influence-zoo``), and :func:`import_optional` for the functions
that import an optional module.
"""

import importlib
import importlib.util
from types import MappingProxyType, ModuleType

# extra (setup.cfg [options.extras_require]) -> the top-level modules it installs that our code, our tests or rl_zoo3
# import. A module of several extras is named with the first that has it, unless the command's own extra has it too.
EXTRA_MODULES: "MappingProxyType[str, tuple[str, ...]]" = MappingProxyType(
    {
        "analysis": ("matplotlib",),
        "tensorboard": ("tensorboard",),
        "zoo": (
            "rl_zoo3",
            "optuna",
            "yaml",
            "tqdm",
            "rich",
            "requests",
            "huggingface_sb3",
            "huggingface_hub",
            "seaborn",
            "matplotlib",
            "pytablewriter",
            "moviepy",
            "pygame",
            "tensorboard",
        ),
        "bench": ("rliable", "highway_env", "matplotlib"),
        "distributed": ("ray", "psycopg"),
        "minigrid": ("minigrid",),
        "box2d": ("Box2D",),
        "mujoco": ("mujoco",),
    }
)


def missing_module_message(error: ModuleNotFoundError, command: str, extra: str | None = None) -> str:
    """
    One line naming the module that is missing and the extra that installs it.

    :param error: The error raised by the import.
    :param command: The command that needed the module (first word of the message).
    :param extra: The extra of ``command``: named when it installs the module, even if another extra does too.
    :return: The message, e.g.
        ``"error: sb3-influence report: No module named 'matplotlib': pip install 'sb3_influence[analysis]'"``.
    """
    module = (error.name or "").partition(".")[0]
    candidates = [name for name, modules in EXTRA_MODULES.items() if module in modules]
    if extra in candidates:
        candidates = [extra]
    if not module:
        return f"error: {command}: {error}"
    if not candidates:
        return f"error: {command}: No module named {module!r}, which no sb3_influence extra installs: install its package"
    return f"error: {command}: No module named {module!r}: pip install 'sb3_influence[{candidates[0]}]'"


def import_optional(name: str, extra: str, needed_by: str) -> ModuleType:
    """
    Import an optional module, or say which extra installs it.

    :param name: The module, e.g. ``"matplotlib.figure"``.
    :param extra: The extra that installs it.
    :param needed_by: What needs it (first words of the error), e.g. ``"plot_phases()"``.
    :return: The module.
    :raises ModuleNotFoundError: When the module's package is not installed, naming the extra, e.g.
        ``"plot_phases() needs 'matplotlib', which is not installed: pip install 'sb3_influence[analysis]'"``. A
        module missing from an installed package, or from what it imports (a broken install), is raised as it is.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        package = name.partition(".")[0]
        if importlib.util.find_spec(package) is not None:
            raise
        raise ModuleNotFoundError(
            f"{needed_by} needs {package!r}, which is not installed: pip install 'sb3_influence[{extra}]'",
            name=package,
        ) from error
