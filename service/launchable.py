"""Whether a command could start as the worker starts it (no shell, in its directory, as its
owner), checked at submit and again at resubmit rather than found out when the job reaches a GPU:
its directory, its program, and a script's ``#!`` line (the worker's diagnosis of a start that
failed, workers/command.py, reads that line with ``interpreter_of``, as the owner too)."""

from __future__ import annotations

import os
import re
import stat

from gpuq.service import reach
from gpuq.service.errors import InvalidSpec


def check_command(argv: list[str], workdir: str, path: str) -> None:
    """Refuse (InvalidSpec, one line) a command that could not start as the worker starts it (no
    shell, in ``workdir``, its program looked up on ``path``): its working directory, its program,
    and a script's first line (``_check_start``). As the job's owner meets them (service/reach.py,
    under ``reach.as_owner``): the server may be root. A submit's check, and a resubmit's."""
    if not reach.is_dir(workdir):
        raise InvalidSpec(f"working directory {workdir} does not exist{reach.closed()}")
    program = argv[0]
    if os.sep in program:
        target = program if os.path.isabs(program) else os.path.join(workdir, program)
        if not reach.is_executable(target):
            raise InvalidSpec(f"{program} is not an executable file (from {workdir}){reach.closed()}")
    else:
        found = reach.which(program, path, workdir)
        if found is None:
            raise InvalidSpec(f"command not found: {program} (not on PATH)")
        target = found
    _check_start(program, target, workdir, path)


# The most of a program a submit reads: the kernel looks for a #! line in its first 256 bytes
# (BINPRM_BUF_SIZE).
SHEBANG_BYTES = 256


def shebang_words(first: bytes) -> list[bytes] | None:
    """The words of a script's ``#!`` line (``first``: its first line, or the start of the file),
    split on spaces and tabs as the kernel splits it (a carriage return stays part of a word); None
    for a file that does not start with ``#!``."""
    if not first.startswith(b"#!"):
        return None
    line = first[2:].split(b"\n", 1)[0]
    return [w for w in line.replace(b"\t", b" ").split(b" ") if w]


def kernel_argv(first: bytes) -> list[str] | None:
    """What the kernel runs a script with (``first``: the start of the file): its ``#!`` line's
    program and at most one argument, the rest of the line whole (``#!/usr/bin/env -S python3 -u``:
    ``/usr/bin/env``, ``-S python3 -u``); None for a file without such a line."""
    if not first.startswith(b"#!"):
        return None
    line = first[2:].split(b"\n", 1)[0].strip(b" \t")
    # As binfmt_script: the program ends at the first blank (space or tab); the argument is the
    # rest, its own tabs kept.
    words = re.split(rb"[ \t]", line, maxsplit=1) if line else []
    return [os.fsdecode(w.strip(b" \t")) for w in words if w.strip(b" \t")] or None


def interpreter_of(target: str) -> str | None:
    """The program ``target``'s ``#!`` line names (its first word, a carriage return kept), read
    as ``_start_of`` reads it: only a file its owner may read (under ``reach.as_owner``). None for
    a file with no such line, or one closed to the owner."""
    head = _start_of(target)
    words = shebang_words(head) if head is not None else None
    return os.fsdecode(words[0]) if words else None


def _check_start(program: str, target: str, workdir: str, path: str) -> None:
    """Refuse a program file the kernel would not start, as the worker finds out only when the job
    reaches a GPU (workers/command.py): a ``#!`` line with Windows line endings, a ``#!`` naming
    no executable file (``#!/usr/bin/env NAME``: NAME not on the job's PATH), or a text file
    without a ``#!`` line (ENOEXEC: there is no shell to fall back on, as sbatch refuses). Only a
    file its owner may read is read (an execute-only binary is not); a file of another binary
    format than ELF is left to the kernel, which binfmt_misc may teach to run it."""
    head = _start_of(target)
    if head is None or head.startswith(b"\x7fELF"):
        return
    words = shebang_words(head)
    if words is None:
        if b"\x00" not in head:
            raise InvalidSpec(f"{program} has no #! line, and gpuq runs it without a shell: "
                              "add #!/bin/sh or similar as its first line")
        return
    whole = b"\n" in head or len(head) < SHEBANG_BYTES  # else a line too long to judge: the kernel's
    line = head[2:].split(b"\n", 1)[0]
    if line.endswith(b"\r") or (words and b"\r" in words[0]):
        raise InvalidSpec(f"{program}: its #! line ends in a carriage return (Windows line endings), so it "
                          f"cannot start: convert it (dos2unix {program})")
    if not whole:
        return
    if not words:
        raise InvalidSpec(f"{program}: its #! line names no interpreter: write one, as #!/bin/sh")
    interpreter = os.fsdecode(words[0])
    where = interpreter if os.path.isabs(interpreter) else os.path.join(workdir, interpreter)
    if not reach.is_executable(where):
        raise InvalidSpec(f"{program}: its #! interpreter {interpreter} does not exist or is not executable"
                          f"{reach.closed()}: correct its first line")
    # The kernel passes the rest of the line as one argument: `#!/usr/bin/env python3` has env look
    # python3 up on the job's PATH. Options (-S) and assignments are env's to read.
    rest = os.fsdecode(line.strip(b" \t").removeprefix(words[0]).strip(b" \t"))
    if os.path.basename(interpreter) != "env" or not rest or rest.startswith("-") or "=" in rest.split()[0]:
        return
    if any(ch in rest for ch in " \t"):
        # One word to env, as the kernel hands it over: env looks for a program named "python3 -u".
        raise InvalidSpec(f"{program}: its #! line gives env {rest!r} as one word (the kernel does not split it), "
                          f"so it cannot start: write #!/usr/bin/env -S {rest}")
    found = (reach.is_executable(os.path.join(workdir, rest)) if os.sep in rest
             else reach.which(rest, path, workdir) is not None)
    if not found:
        raise InvalidSpec(f"{program}: its #! line runs {rest} through env, and {rest} is not on the job's PATH"
                          f"{reach.closed()}")


def _start_of(target: str) -> bytes | None:
    """The first ``SHEBANG_BYTES`` of ``target`` where it is a regular file its owner may read, else
    None. The server may be root: it reads nothing on a user's behalf that the user could not read,
    so the path is checked as the owner's (``reach.is_file``), and the file then opened too
    (``reach.may_read``: one swapped in between is not read with root's rights), and the path
    walked again to the file opened (``reach.still_reaches``: a link flipped to another user's file
    behind a directory closed to the owner, between the check and the open, is not read)."""
    if not reach.is_file(target):
        return None
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not reach.may_read(fd) or not reach.still_reaches(target, fd):
            return None
        return os.pread(fd, SHEBANG_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
