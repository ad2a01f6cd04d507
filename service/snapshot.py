"""The code as it was at submit time: a command job's git commit, dirty flag and diff, and with
``--snapshot`` a copy of the work tree that the job runs from.

Git is asked, never parsed from ``.git``: ``rev-parse`` for the top level and commit, ``status`` for
dirtiness, ``diff HEAD`` for the changes (a submodule's inline), ``ls-files`` for what a snapshot
copies (tracked files and untracked ones that .gitignore does not exclude, and each checked-out
submodule's, listed by its own git). No git, or a directory outside a work tree, means
nothing is recorded; only ``--snapshot`` makes that an error.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuq.service.errors import InvalidSpec
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.snapshot")

GIT_TIMEOUT_S = 30.0  # a git call on a huge or network-mounted tree; past it, nothing is recorded
DIFF_CUT_NOTE = "\n[gpuq: diff cut at {limit} bytes]\n"


@dataclass(frozen=True)
class GitState:
    """Where a work tree stood: its top level, commit (None before the first one), dirtiness, diff."""

    top: str
    commit: str | None
    dirty: bool
    diff: str
    diff_cut: bool


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    try:
        return subprocess.run(["git", "-C", cwd, *args], capture_output=True, timeout=GIT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def work_tree(cwd: str) -> str | None:
    """The top of the work tree holding ``cwd``: inside a submodule, its outermost superproject's
    (the job's code is the project's, which its submodule's may import from); None outside one."""
    top: str | None = None
    where = cwd
    while True:  # one git call where cwd is in no submodule: the top and its superproject (none)
        out = _git(where, "rev-parse", "--show-toplevel", "--show-superproject-working-tree")
        lines = out.stdout.decode("utf-8", "surrogateescape").splitlines() if out is not None and \
            out.returncode == 0 else []
        if not lines or not lines[0].strip():
            return top
        top = lines[0].strip()
        if len(lines) < 2 or not lines[1].strip():
            return top
        where = lines[1].strip()


def capture(cwd: str, max_diff_bytes: int) -> GitState | None:
    """The git state of the work tree holding ``cwd`` (``work_tree``: a submodule's superproject's);
    None outside one or without git."""
    top = work_tree(cwd)
    if top is None:
        return None
    head = _git(top, "rev-parse", "--verify", "--quiet", "HEAD")
    commit = head.stdout.decode().strip() or None if head is not None and head.returncode == 0 else None
    status = _git(top, "status", "--porcelain", "--untracked-files=normal")
    dirty = bool(status is not None and status.stdout.strip())
    diff_bytes = b""
    if commit:  # staged and unstaged changes to tracked files; untracked ones only count as dirty
        # --submodule=diff: a submodule's changes (its commit moved, its own edits) as the lines
        # that changed in it, where plain diff gives only its two commit ids.
        out = _git(top, "diff", "HEAD", "--no-color", "--no-ext-diff", "--submodule=diff")
        diff_bytes = out.stdout if out is not None and out.returncode == 0 else b""
    cut = len(diff_bytes) > max_diff_bytes
    diff = diff_bytes[:max_diff_bytes].decode("utf-8", errors="replace").replace("\x00", "")
    if cut:
        diff += DIFF_CUT_NOTE.format(limit=max_diff_bytes)
    return GitState(top=top, commit=commit, dirty=dirty, diff=diff, diff_cut=cut)


class Staged:
    """A work tree copied into the snapshot directory under a temporary name, until ``place``
    renames it after the job id; ``discard`` removes it wherever it is."""

    def __init__(self, path: Path, rel: str) -> None:
        self.path = path
        self.rel = rel  # where the job was submitted from, relative to the work tree's top

    def place(self, job_id: int) -> Path:
        """Rename the copy to the job's own directory; returns it."""
        final = self.path.parent / str(job_id)
        if final.exists():
            # Not this queue's: left by an earlier database whose ids this one uses again (a fresh
            # `gpuq up` over the same snapshot directory). Renaming onto it failed every snapshot
            # submit of this id, the server's "see its log" to the user. Kept, under another name.
            aside = final.with_name(f"{job_id}.earlier-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            log.warning("snapshot directory %s was there already (an earlier queue's?): moved to %s", final, aside)
        os.rename(self.path, final)  # atomic on one filesystem: the job's directory is whole or absent
        self.path = final
        return final

    def workdir(self) -> str:
        """Where the job runs: the submit directory's place inside the snapshot."""
        return str(self.path / self.rel) if self.rel != "." else str(self.path)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# What copies a work tree for a submit: ``stage`` here, or the server's copy made as the submitter.
Stager = Callable[[Settings, str, "GitState | None"], "Staged"]


def stage(settings: Settings, cwd: str, git: GitState | None) -> Staged:
    """Copy the files git lists for the work tree of ``cwd`` to a temporary directory under the
    snapshot directory. InvalidSpec (nothing left behind) outside a work tree or over the size limit."""
    root = settings.snapshots
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidSpec(f"--snapshot: cannot create {root}: {exc.strerror}") from None
    path = root / f".incoming-{uuid.uuid4().hex}"
    path.mkdir()
    try:
        return Staged(path, copy_tree(cwd, git, path, settings.snapshot_max_bytes))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def copy_tree(cwd: str, git: GitState | None, target: Path, max_bytes: int) -> str:
    """Copy the files git lists for the work tree of ``cwd`` into the empty directory ``target``;
    returns where ``cwd`` is relative to the work tree's top. InvalidSpec outside a work tree or
    over ``max_bytes``; the caller removes ``target`` on any error."""
    if git is None:
        raise InvalidSpec(f"--snapshot needs a git work tree, and {cwd} is not in one (or git is not installed)")
    files = []
    total = 0
    for name, src, size in _listed(git.top, ""):
        files.append((name, src))
        total += size
    if total > max_bytes:
        raise InvalidSpec(f"--snapshot: the work tree {git.top} holds {total / 2**20:.1f} MiB of files; the limit "
                          f"is {max_bytes / 2**20:.1f} MiB (GPUQ_SNAPSHOT_MAX_BYTES)")
    rel = os.path.relpath(os.path.realpath(cwd), git.top)
    try:
        for name, src in files:
            dst = target / name
            if src is None:
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        (target / rel).mkdir(parents=True, exist_ok=True)  # an untracked-only submit directory
    except OSError as exc:
        raise InvalidSpec(f"--snapshot: copying {git.top} failed: {exc}") from None
    return rel


def _listed(top: str, prefix: str) -> Iterator[tuple[str, str | None, int]]:
    """(name under the snapshot, path, size) of each file git lists for the work tree ``top``
    (tracked, and untracked that .gitignore does not exclude), whose names start with ``prefix``;
    a submodule's files (or a git work tree's of its own inside, untracked) listed by their own git
    in turn, as the job would find them in the tree; path None for a directory to make empty (a
    submodule not checked out). InvalidSpec where git cannot list them."""
    listed = _git(top, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is None or listed.returncode != 0:
        raise InvalidSpec(f"--snapshot: git could not list the files of {top}")
    for name in dict.fromkeys(p for p in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if p):
        src = os.path.join(top, name)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            continue  # tracked but deleted in the work tree: the job sees it deleted
        if stat.S_ISDIR(st.st_mode):
            # A submodule (or an untracked repository, listed as "name/"): its files are its own
            # git's to list. One not checked out is an empty directory, in the copy as in the tree.
            inner = _git(src, "rev-parse", "--show-toplevel")
            if inner is not None and inner.returncode == 0 and os.path.realpath(
                    inner.stdout.decode("utf-8", "surrogateescape").strip()) == os.path.realpath(src):
                yield from _listed(src, prefix + name.rstrip("/") + "/")
            else:
                yield prefix + name.rstrip("/"), None, 0
            continue
        yield prefix + name, src, st.st_size


def main(argv: list[str]) -> int:
    """``python -m gpuq.service.snapshot TARGET CWD MAX_BYTES``: the server's copy of a work tree,
    run as the submitting user (so it reads only what they may); prints {"rel": ...} or {"error": ...}."""
    import json

    target, cwd, max_bytes = Path(argv[0]), argv[1], int(argv[2])
    try:
        rel = copy_tree(cwd, capture(cwd, 0), target, max_bytes)
    except InvalidSpec as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    print(json.dumps({"rel": rel}))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
