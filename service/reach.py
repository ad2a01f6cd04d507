"""What a job's owner can reach on this node, for the checks a submit makes of its paths.

The server checks a submit's directory, program and workload paths (a typo is one line now, not a
failed job later). On a machine's stack it runs as root, and root's checks answer for every path:
"is not an executable file" for one in a directory the user may not enter told them it existed.
So the checks run ``as_owner``: a path counts only if the owner could reach it, by the kernel's rule
for every directory on the way and for the path itself (the owner's uid, primary group and groups):
its POSIX ACL where it has one (``setfacl``: a lab's shared project directory often opens to a
group or a colleague that way), else its mode bits. The job itself meets the kernel's check in
full; what this cannot see (a mount's own rules, SELinux) can only close a path the check opened.

A server not run by root checks with its own rights, which are its one user's.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

_R, _W, _X = 4, 2, 1


@dataclass(frozen=True)
class _Owner:
    name: str
    uid: int
    gids: frozenset[int]


_OWNER: ContextVar[_Owner | None] = ContextVar("gpuq_path_owner", default=None)


@contextmanager
def as_owner(user: str) -> Iterator[None]:
    """Meanwhile, this module's checks answer for ``user`` (root's answers for root, or when this
    process is not root)."""
    owner = None
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(user)
            if entry.pw_uid != 0:
                owner = _Owner(user, entry.pw_uid, frozenset(os.getgrouplist(user, entry.pw_gid)))
        except KeyError:  # no account here (a MUNGE caller's uid:N): what everyone may reach
            owner = _Owner(user, -1, frozenset())
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def owner_name() -> str | None:
    """The user the checks answer for now; None: this process's own."""
    owner = _OWNER.get()
    return owner.name if owner is not None else None


def closed() -> str:
    """For a message after "does not exist": " or is closed to alice" while checking as a user (a
    path they may not reach reads the same as one that is not there), else nothing."""
    owner = _OWNER.get()
    return f" or is closed to {owner.name}" if owner is not None else ""


def _allows(path: str | int, st: os.stat_result, owner: _Owner, bit: int) -> bool:
    acl = _acl(path)
    if acl is not None:
        return _acl_allows(acl, st, owner, bit)
    if st.st_uid == owner.uid:
        return bool((st.st_mode >> 6) & bit)
    if st.st_gid in owner.gids:
        return bool((st.st_mode >> 3) & bit)
    return bool(st.st_mode & bit)


# The tags of a POSIX ACL's entries, as Linux stores them (linux/posix_acl_xattr.h).
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_VERSION = 2
_ENTRY = struct.Struct("<HHI")  # tag, permissions (rwx as in a mode), uid or gid


def _acl(path: str | int) -> list[tuple[int, int, int]] | None:
    """The path's (or open file's) access ACL as (tag, perm, id) entries; None where it has none (its mode bits say
    it all) or the file system keeps none."""
    try:
        raw = os.getxattr(path, "system.posix_acl_access")
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        return None
    return [_ENTRY.unpack_from(raw, at) for at in range(4, len(raw) - _ENTRY.size + 1, _ENTRY.size)]


def _acl_allows(acl: list[tuple[int, int, int]], st: os.stat_result, owner: _Owner, bit: int) -> bool:
    """The kernel's ACL check (acl(5), "access check algorithm"): the owner's entry; else a named
    user's, within the mask; else the groups' (the file's group and named groups the owner is in),
    any of which may grant within the mask, and matching one that does not is a refusal; else other."""
    mask = next((perm for tag, perm, _ in acl if tag == _MASK), 7)
    if st.st_uid == owner.uid:
        return any(tag == _USER_OBJ and perm & bit for tag, perm, _ in acl)
    for tag, perm, uid in acl:
        if tag == _USER and uid == owner.uid:
            return bool(perm & mask & bit)
    groups = [perm for tag, perm, gid in acl
              if (tag == _GROUP_OBJ and st.st_gid in owner.gids) or (tag == _GROUP and gid in owner.gids)]
    if groups:
        return any(perm & mask & bit for perm in groups)
    return any(tag == _OTHER and perm & bit for tag, perm, _ in acl)


# As the kernel's: a path that meets more symbolic links than this is refused (ELOOP).
_MAX_LINKS = 40


def _on_the_way(path: str, owner: _Owner) -> bool:
    """Whether ``owner`` may search every directory the kernel would look a name up in to reach
    ``path``: walked a name at a time as the kernel resolves it, symbolic links followed where they
    are met and ``..`` taken from where the walk stands, not from the text. (Checking the path as
    written and as ``realpath`` gives it missed the directories a link passes through, so
    ``link -> /home/ann/private/proj/../../x`` told whether ann's private ``proj`` existed.)"""
    names = (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).split("/")
    names.reverse()  # a stack: the next name last
    current, links = "/", 0
    while names:
        name = names.pop()
        if name in ("", "."):
            continue
        try:
            if not _allows(current, os.stat(current), owner, _X):  # a lookup in ``current``
                return False
            if name == "..":
                current = os.path.dirname(current)
                continue
            candidate = os.path.join(current, name)
            st = os.lstat(candidate)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    return False
                target = os.readlink(candidate)
                names.extend(reversed(target.split("/")))
                if os.path.isabs(target):
                    current = "/"
                continue
        except OSError:
            return False
        if names and not stat.S_ISDIR(st.st_mode):
            return False  # a name looked up in a file
        current = candidate
    return True


def _stat(path: str, bit: int) -> os.stat_result | None:
    """The path's stat if it is there for the owner, with ``bit`` of its mode theirs; else None."""
    owner = _OWNER.get()
    if owner is not None and not _on_the_way(path, owner):
        return None
    try:
        st = os.stat(path)
        if owner is None:
            return st if os.access(path, os.R_OK if bit == _R else os.X_OK) else None
        return st if _allows(path, st, owner, bit) else None
    except OSError:
        return None


def is_dir(path: str) -> bool:
    """A directory the owner may enter."""
    st = _stat(path, _X)
    return st is not None and stat.S_ISDIR(st.st_mode)


def is_writable_dir(path: str) -> bool:
    """A directory the owner may make files in (write and search: a checkpoint is written beside
    itself and renamed over the old one)."""
    st = _stat(path, _X)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    owner = _OWNER.get()
    if owner is None:
        return os.access(path, os.W_OK | os.X_OK)
    return _allows(path, st, owner, _W)


def is_file(path: str) -> bool:
    """A file the owner may read."""
    st = _stat(path, _R)
    return st is not None and stat.S_ISREG(st.st_mode)


def may_read(fd: int) -> bool:
    """Whether the owner may read the file open as ``fd``, by its own rights (its ACL, else its mode
    bits): after ``is_file`` of the path it was opened by, a file swapped in between is not read
    with this process's rights."""
    owner = _OWNER.get()
    if owner is None:  # opened with this process's own rights, which are the owner's
        return True
    try:
        return _allows(fd, os.fstat(fd), owner, _R)
    except OSError:
        return False


def still_reaches(path: str, fd: int) -> bool:
    """Whether ``path``, walked again as the owner (``is_file``) after ``fd`` was opened by it with
    this process's rights, leads the owner to the very file ``fd`` holds (its device and inode). A
    path swapped between the first check and the open (a link flipped to a file behind another
    user's closed directory) leads elsewhere: one swapped back for this check leads to another
    inode than the one opened. Without it the swap leaked that file's first line."""
    st = _stat(path, _R)
    if st is None:
        return False
    try:
        held = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def is_executable(path: str) -> bool:
    """A file the owner may run."""
    st = _stat(path, _X)
    return st is not None and stat.S_ISREG(st.st_mode)


def which(program: str, path: str, workdir: str) -> str | None:
    """``program`` on ``path`` as the owner's shell would find it, in ``workdir``: a relative entry
    of ``path`` (``bin``, or an empty one: the directory itself) is taken from ``workdir``, where
    the job starts, never from the server's own directory."""
    for directory in path.split(os.pathsep):
        candidate = os.path.join(workdir, directory, program)  # an absolute entry drops workdir
        if is_executable(candidate):
            return candidate
    return None
