"""What the sub-commands of ``sb3-influence`` share: one-line errors for bad inputs, never a traceback."""

import argparse
import sys
from typing import NoReturn

#: Exceptions that report a bad input rather than a bug (gymnasium's own errors are added when it is imported)
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, OSError)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``error: PROG: message``, with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that report a bad input rather than a bug."""
    gymnasium_error = sys.modules.get("gymnasium.error")
    return USER_ERRORS + ((gymnasium_error.Error,) if gymnasium_error is not None else ())


def one_line(error: BaseException) -> str:
    """An exception's message on one line (``KeyError`` without its quotes)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(text.split()) or type(error).__name__
