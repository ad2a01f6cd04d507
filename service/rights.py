"""Who may do what to a job: the one place the server, the dashboard and the CLI's admin paths ask.

A caller is who the kernel (a Unix socket's peer uid) or munged (a MUNGE credential) says is
asking, never a name the request carries. What everyone may see is what squeue shows: states,
names, users, resources. A job's output, recorded diff and environment values are its owner's,
root's and the admins' (``GPUQ_ADMINS``); ``GPUQ_SHARED_LOGS`` opens output, and only output, to all.
"""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass

from gpuq.service.errors import InvalidSpec, NotAllowed
from gpuq.service.settings import Settings

_USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,63}\$?", re.IGNORECASE)


@dataclass(frozen=True)
class Caller:
    """Who is asking: a uid the kernel or munged vouched for, and its user name on this node."""

    uid: int
    user: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @classmethod
    def of(cls, who: Caller | str | None) -> Caller:
        """``who`` as a caller: a Caller as it is, a user name with its uid on this node (-1 for
        none), None for this process's own user."""
        if isinstance(who, Caller):
            return who
        if who is None:
            return cls.of_uid(os.getuid())
        try:
            return cls(pwd.getpwnam(who).pw_uid, who)
        except KeyError:
            return cls(-1, who)

    @classmethod
    def of_uid(cls, uid: int) -> Caller:
        """The caller with ``uid``; a uid without a passwd entry is named ``uid:N``, a name no account
        can have (a colon separates passwd's fields): as ``uidN`` it was the jobs of a local user
        who happened to be called that, for a caller from another node with that uid."""
        try:
            return cls(uid, pwd.getpwuid(uid).pw_name)
        except KeyError:
            return cls(uid, unnamed(uid))


def unnamed(uid: int) -> str:
    """The name gpuq gives a uid with no account here."""
    return f"uid:{uid}"


def check_served(caller: Caller) -> None:
    """NotAllowed unless this server acts for ``caller``: run as root, for every user of the
    machine; run by a user (their own stack, whose workers cannot switch users and run every job
    as that user), for that user alone."""
    me = os.geteuid()
    if me != 0 and caller.uid != me:
        owner = Caller.of_uid(me).user
        raise NotAllowed(f"this gpuq server is {owner}'s own stack (not run by root) and serves only {owner}: "
                         "start your own with `gpuq up`, or use the machine's (`sudo gpuq up`)")


# The dashboard's visitors are nobody in particular: they see what every user may see.
ANYONE = None


def is_admin(settings: Settings, caller: Caller | None) -> bool:
    """Root, the users named in ``GPUQ_ADMINS`` (read from the server's own settings), and on a
    user's own stack (a server not run by root) that user, who can drain it and take it down anyway."""
    return caller is not None and (caller.is_root or caller.uid == os.geteuid() or caller.user in settings.admin_users)


def is_admin_user(settings: Settings, user: str) -> bool:
    """``is_admin`` for a user named in a job (its owner), with the uid that name has here."""
    return is_admin(settings, Caller.of(user))


def may_change(settings: Settings, owner: str, caller: Caller | None) -> bool:
    """Whether ``caller`` may cancel, hold, release, update or resubmit a job of ``owner``."""
    return caller is not None and (caller.user == owner or is_admin(settings, caller))


def check_change(settings: Settings, job_id: int, owner: str, caller: Caller | None) -> None:
    """NotAllowed unless ``caller`` may change job ``job_id`` of ``owner``."""
    if not may_change(settings, owner, caller):
        raise NotAllowed(f"job {job_id} belongs to {owner}; only they or an admin may change it")


def may_read_output(settings: Settings, owner: str, caller: Caller | None) -> bool:
    """Whether ``caller`` may read a job's output (`gpuq logs`, `show`'s last lines)."""
    return settings.shared_logs or may_change(settings, owner, caller)


def check_read_output(settings: Settings, job_id: int, owner: str, caller: Caller | None) -> None:
    if not may_read_output(settings, owner, caller):
        raise NotAllowed(f"job {job_id} belongs to {owner}; only they or an admin may read its output")


def may_read_private(settings: Settings, owner: str, caller: Caller | None) -> bool:
    """Whether ``caller`` may read a job's recorded diff and environment values: its owner's
    uncommitted code and variables, never opened by ``GPUQ_SHARED_LOGS``."""
    return may_change(settings, owner, caller)


def check_read_private(settings: Settings, job_id: int, owner: str, caller: Caller | None) -> None:
    if not may_read_private(settings, owner, caller):
        raise NotAllowed(f"job {job_id} belongs to {owner}; only they or an admin may read its recorded code")


def check_admin(settings: Settings, caller: Caller | None, what: str) -> None:
    if not is_admin(settings, caller):
        raise NotAllowed(f"only root or an admin (GPUQ_ADMINS) may {what}")


def submitter(caller: Caller, requested: str | None) -> str:
    """Whose a submission is: the caller's, or ``requested`` if the caller is root. A job runs as
    its owner on a root worker, so submitting as another user is running code as them."""
    if requested is None or requested == caller.user:
        return caller.user
    if not caller.is_root:
        raise NotAllowed(f"only root may submit as another user (--user {requested}); you are {caller.user}")
    if not _USER_NAME.fullmatch(requested):
        raise InvalidSpec(f"--user {requested!r} is not a user name")
    # As sbatch --uid: a name this node does not know is a typo, refused now rather than queued to
    # fail on its node (a root worker refuses an owner its node does not know, for a node whose
    # accounts differ from the server's).
    try:
        pwd.getpwnam(requested)
    except KeyError:
        raise InvalidSpec(f"--user {requested}: no such user on this node") from None
    return requested
