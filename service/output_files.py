"""A command's output written to files of the user's own as well (`--output`, `--error`), as
sbatch's ``-o`` and ``-e``: checked at submit, their patterns filled in when the job starts.

gpuq keeps every job's output in its own store (`gpuq logs`, failure classes read it); these files
are a copy, written as the job runs, in the user's directory and with the user's rights: the
worker opens them in the job's own process after it became the user (workers/command.py), so a
root worker writes nothing there that the user could not.
"""

from __future__ import annotations

import os
import re

from gpuq.service.errors import InvalidSpec

MAX_PATH_BYTES = 4096  # PATH_MAX
# What a pattern fills in, as sbatch's filename patterns: %j the job's id, %A its array's id (the
# job's own outside an array), %a its array index (empty outside an array), %x its name, %u its
# user, %N the node it runs on, %% a percent sign.
_TOKEN = re.compile(r"%(.)", re.DOTALL)
TOKENS = "jAaxuN%"


def check(option: str, path: str | None) -> str | None:
    """``path`` as given to ``option`` (the client makes it absolute from its directory), or None;
    InvalidSpec for one that is not absolute, holds a NUL, is too long, or has a % that fills in
    nothing."""
    if path is None:
        return None
    if not path or not os.path.isabs(path):
        raise InvalidSpec(f"{option} must be an absolute path (the client makes a relative one absolute)")
    if "\x00" in path or path.endswith("/"):
        raise InvalidSpec(f"{option} must name a file; got {path[:200]!r}")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidSpec(f"{option} is longer than {MAX_PATH_BYTES} bytes")
    for token in _TOKEN.findall(path):
        if token not in TOKENS:
            raise InvalidSpec(f"{option}: %{token} fills in nothing (%j job id, %A array id, %a array index, "
                              "%x name, %u user, %N node, %% a percent sign)")
    if "%" in _TOKEN.sub("", path):
        raise InvalidSpec(f"{option}: a lone % at its end fills in nothing (%% for a percent sign)")
    return path


def fill(path: str, *, job_id: int, array_id: int | None, array_index: int | None, name: str, user: str,
         node: str) -> str:
    """``path`` with its patterns filled in for one job. A name's slashes become underscores: a
    name is a label, not a way into another directory."""
    values = {"j": str(job_id), **_array_values(array_id if array_id is not None else job_id, array_index),
              "x": name.replace("/", "_"), "u": user, "N": node.split(".")[0], "%": "%"}
    return _TOKEN.sub(lambda m: values[m.group(1)], path)


def fill_array(path: str | None, array_id: int | None, array_index: int | None) -> str | None:
    """``path`` with only %A and %a filled in (the rest left for ``fill``), for a resubmit of an
    array's task: the new job is no task, and its output goes to the file of the task it repeats
    (run_%A_%a.log), not to one whose index is empty."""
    if path is None or array_id is None:
        return path
    values = _array_values(array_id, array_index)
    return _TOKEN.sub(lambda m: values.get(m.group(1), m.group(0)), path)


def _array_values(array_id: int, array_index: int | None) -> dict[str, str]:
    """What %A and %a fill in: the array's id (a job's own outside one) and its index (empty outside one)."""
    return {"A": str(array_id), "a": "" if array_index is None else str(array_index)}
