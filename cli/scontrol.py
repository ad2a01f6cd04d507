"""`scontrol` inside a gpuq job from a SLURM script, or in a `gpuq alloc` shell: what a batch
script asks it for its own use.

Put beside gpuq's srun on the job's PATH (service/slurm_bin.py). ``show hostnames`` (``hostname``)
expands a SLURM host list (``n[01-03],gpu7``: one name a line), as a DDP script finds its first node
for ``MASTER_ADDR``, and ``show hostlist`` joins names into one, the job's own node list where none
is given. ``requeue``, ``requeuehold``, ``hold``, ``release`` and ``show job`` of job ids (the job's
own where none is given: a script that requeues itself before its time limit, on the signal it
asked for) are gpuq's commands for them, run as the job's user through gpuq's server. Anything else
is refused in one line that names gpuq's command for it, exit 2.
"""

from __future__ import annotations

import os
import re
import sys

# For the refusal: scontrol's commands a job script may run, and gpuq's for each.
_GPUQ_FOR = {"show job": "gpuq show", "requeue": "gpuq requeue", "requeuehold": "gpuq requeue --hold",
             "hold": "gpuq hold", "release": "gpuq release", "update": "gpuq update", "top": "gpuq update --priority"}
# Those run as gpuq's: scontrol's words, and gpuq's command line before the job ids.
_RUN_AS = {("requeue",): ["requeue"], ("requeuehold",): ["requeue", "--hold"], ("hold",): ["hold"],
           ("release",): ["release"], ("show", "job"): ["show"]}
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class Refused(Exception):
    """A command line this scontrol does not run, in the words to say it."""


def expand(hostlist: str) -> list[str]:
    """The names a SLURM host list gives, in its order: ``n[01-03,7]-ib,gpu`` is n01-ib, n02-ib,
    n03-ib, n7-ib, gpu. Refused for brackets that do not close or a range that is none."""
    names: list[str] = []
    for item in _split(hostlist.strip()):
        names += _expand_one(item)
    return names


def _split(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise Refused(f"{text[:80]!r}: not a host list")
        if char == "," and depth == 0:
            items.append(text[start:at])
            start = at + 1
    if depth:
        raise Refused(f"{text[:80]!r}: not a host list (a bracket is not closed)")
    return [item for item in [*items, text[start:]] if item]


def _expand_one(item: str) -> list[str]:
    opened = item.find("[")
    if opened < 0:
        return [item]
    closed = item.index("]", opened)
    head, tail = item[:opened], _expand_one(item[closed + 1:])
    out = []
    for part in item[opened + 1:closed].split(","):
        match = _RANGE.fullmatch(part)
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise Refused(f"{item[:80]!r}: not a host list ({part!r} is no range)")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) - int(first) > 65536:
            raise Refused(f"{item[:80]!r}: a range of more than 65,536 hosts")
        width = len(first) if first.startswith("0") else 0
        out += [f"{head}{n:0{width}d}{rest}" for n in range(int(first), int(last) + 1) for rest in tail]
    return out


def main(argv: list[str]) -> int:
    words = [w for w in argv if not w.startswith("-")]  # -o (one line), -d, -Q: the same here
    try:
        if len(words) in (2, 3) and words[0] == "show" and words[1] in ("hostnames", "hostname", "hostlist"):
            given = words[2] if len(words) == 3 else os.environ.get("SLURM_JOB_NODELIST", "")
            if not given:
                raise Refused(f"show {words[1]}: name a host list (no SLURM_JOB_NODELIST here)")
            names = expand(given)
            print("\n".join(names) if words[1] != "hostlist" else ",".join(names))
            return 0
        for named, command in _RUN_AS.items():
            if tuple(words[:len(named)]) == named:
                return _gpuq(command, words[len(named):])
        asked = " ".join(words[:2]) if words[:2] == ["show", "job"] else words[0] if words else ""
        hint = f"; for this, {_GPUQ_FOR[asked]}" if asked in _GPUQ_FOR else ""
        raise Refused(f"{' '.join(argv)[:60] or 'no command'}: only `show hostnames` and `show hostlist` run here, "
                      f"in a gpuq job{hint}")
    except Refused as refused:
        print(f"gpuq scontrol: {refused}", file=sys.stderr)
        return 2


def _gpuq(command: list[str], ids: list[str]) -> int:
    """gpuq's ``command`` of the job ids scontrol was given (``5,6`` or ``5 6``; the job's own,
    ``SLURM_JOB_ID``, where none), in place of this process."""
    jobs = [i for word in ids for i in word.split(",") if i] or [os.environ.get("SLURM_JOB_ID", "")]
    if not all(jobs):
        raise Refused(f"{' '.join(command)}: name a job (no SLURM_JOB_ID here)")
    if command == ["show"] and len(jobs) > 1:
        raise Refused("show job: one job at a time (gpuq show ID)")
    argv = [sys.executable, "-m", "gpuq.cli", *command, *jobs]
    os.execv(argv[0], argv)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
