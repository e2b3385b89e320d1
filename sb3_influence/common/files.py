"""Writing result files so that a reader never sees half of one."""

import json
import os
from typing import Any


def write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """
    Write ``data`` as JSON to ``path`` atomically: to a temporary file in the same folder, then ``os.replace``
    onto ``path`` (the folder is made if needed; the temporary file is removed if writing fails).

    :param path: The file.
    :param data: JSON-serialisable data (NaN and infinities are written as JSON's non-standard tokens).
    :param indent: JSON indentation.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump(data, file, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def make_folder(path: str, owner: str, argument: str = "save_dir") -> None:
    """
    Create the folder a callback writes to, or raise ``OSError`` naming the owner, the argument and the fix.

    :param path: The folder.
    :param owner: Who asks (e.g. ``"AttributionCallback"``), for the message.
    :param argument: The argument that gave the folder, for the message.
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise OSError(
            error.errno, f"{owner}: cannot create {argument} {path!r} ({error.strerror}): give a folder you can write to"
        ) from error
