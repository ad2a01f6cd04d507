"""Who a command job runs as: its owner when the worker is root, else the worker's own user."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass


class UnknownUser(Exception):
    """The job's owner has no account on this node, so the job cannot run as them."""


@dataclass(frozen=True)
class Identity:
    """A user to run a child as (workers/command.py switches to it between fork and exec) and the
    passwd entry's HOME/USER/LOGNAME/SHELL."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}


def run_as(owner: str, node: str) -> Identity | None:
    """The identity a job of ``owner`` runs under here; None: as the worker itself.

    A root worker never runs a job as root for someone else: it switches to the owner (uid, primary
    group and that user's groups only). A worker that is not root cannot switch and runs every job
    as itself. A root worker whose job's owner is unknown on this node refuses the job.
    """
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(owner)
    except KeyError:
        raise UnknownUser(f"user {owner} is not known on node {node}; the job cannot run as them") from None
    if entry.pw_uid == 0:
        return None
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return Identity(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups,
                    home=entry.pw_dir, shell=entry.pw_shell)
