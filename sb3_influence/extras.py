"""
Which optional extra of sb3_influence installs which module, for the one-line "module not installed" error of every
command line entry point (``sb3-influence``, ``sb3-influence-zoo``).
"""

from types import MappingProxyType

# extra (setup.cfg [options.extras_require]) -> the top-level modules it installs that our code or rl_zoo3 import
EXTRA_MODULES: "MappingProxyType[str, tuple[str, ...]]" = MappingProxyType(
    {
        "zoo": (
            "rl_zoo3",
            "optuna",
            "requests",
            "pandas",
            "huggingface_sb3",
            "huggingface_hub",
            "seaborn",
            "scipy",
            "matplotlib",
            "pytablewriter",
            "moviepy",
            "pygame",
        ),
        "distributed": ("psycopg",),
        "analysis": ("matplotlib", "pandas", "scipy"),
        "tensorboard": ("tensorboard",),
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
        ``"error: sb3-influence report: No module named 'pandas': pip install 'sb3_influence[analysis]'"``.
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
