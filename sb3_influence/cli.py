"""
``sb3-influence``: one command line, one sub-command per job (imported only when used).

A user error (a bad argument, a missing or damaged file, a folder of mixed runs, an unknown env id, a module of an
optional extra that is not installed) ends the command with one line on stderr, ``error: ...``, and exit status 2,
never a traceback. Set the environment
variable ``SB3_INFLUENCE_TRACEBACK=1`` to see the traceback instead.
"""

from types import MappingProxyType
import importlib
import os
import sys

from sb3_influence.common.command_line import one_line, user_errors
from sb3_influence.extras import missing_module_message

# sub-command -> (module, one-line help); each module has ``main(argv: list[str] | None) -> int | None``
COMMANDS = MappingProxyType(
    {
        "run": ("sb3_influence.demo", "train InfluencePPO with IIF on a small default and print an attribution summary"),
        "bench": ("sb3_influence.bench", "run the paper's PPO / IIF / random-filtering comparison and summarise it"),
        "report": ("sb3_influence.analysis.report", "build an HTML report (and PNGs) from a run's attribution snapshots"),
    }
)
# sub-command -> the extra its optional imports come from (named first when a module is missing)
COMMAND_EXTRAS = MappingProxyType({"bench": "bench", "report": "analysis"})


def _usage() -> str:
    lines = ["usage: sb3-influence COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`sb3-influence COMMAND --help` lists a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of ``sb3-influence``.

    :param argv: Command-line arguments (default: ``sys.argv[1:]``).
    :return: The exit status: 0 done, 2 a user error (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: sb3-influence: unknown command {command!r}, use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as error:
        if os.environ.get("SB3_INFLUENCE_TRACEBACK"):
            raise
        print(missing_module_message(error, f"sb3-influence {command}", COMMAND_EXTRAS.get(command)), file=sys.stderr)
        return 2
    except Exception as error:
        if not isinstance(error, user_errors()) or os.environ.get("SB3_INFLUENCE_TRACEBACK"):
            raise
        print(f"error: sb3-influence {command}: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
