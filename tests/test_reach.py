"""The server's checks of a submit's paths answer as the kernel does for the job's owner: by mode
bits, and by a POSIX ACL where a path has one (a lab's shared directory opened to a group or a
colleague with setfacl). Real files, real ACLs, and the kernel itself, as the user, for the answer."""

from __future__ import annotations

import os
import pwd
import struct
import subprocess
from pathlib import Path

import pytest

from gpuq.service import reach

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="checks as another user take root")]

USER = "nobody"
_OBJ = 0xFFFFFFFF  # the id field of the entries that name no one (owner, owning group, mask, other)


def _set_acl(path: Path, *entries: tuple[int, int, int]) -> None:
    """Write ``path``'s access ACL as setfacl would (version 2, entries sorted by tag then id)."""
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in sorted(entries, key=lambda e: (e[0], e[2])))
    os.setxattr(path, "system.posix_acl_access", raw)


def _kernel_says(test: str, path: Path) -> bool:
    """What the kernel answers ``test -<test> path`` as USER."""
    return subprocess.run(["runuser", "-u", USER, "--", "test", f"-{test}", str(path)], timeout=10).returncode == 0


@pytest.fixture
def tree(shared_dir: Path) -> Path:
    return shared_dir


def _cases(uid: int, gid: int) -> list[tuple[str, int, list[tuple[int, int, int]]]]:
    """(what, mode, ACL entries): the ACL's mask and group entries in every way they decide."""
    u_obj, g_obj, other = (0x01, 7, _OBJ), (0x04, 0, _OBJ), (0x20, 0, _OBJ)
    return [
        ("closed by mode, no ACL", 0o700, []),
        ("open by mode, no ACL", 0o755, []),
        ("opened to the user by name", 0o700, [u_obj, (0x02, 5, uid), g_obj, (0x10, 5, _OBJ), other]),
        ("named user, but the mask takes it away", 0o700, [u_obj, (0x02, 5, uid), g_obj, (0x10, 0, _OBJ), other]),
        ("opened to one of the user's groups", 0o700, [u_obj, g_obj, (0x08, 5, gid), (0x10, 5, _OBJ), other]),
        ("a group of theirs matches and refuses: other's bits do not count", 0o700,
         [u_obj, g_obj, (0x08, 0, gid), (0x10, 7, _OBJ), (0x20, 5, _OBJ)]),
        ("open to other, a named user entry for someone else", 0o700,
         [u_obj, (0x02, 0, uid + 1), g_obj, (0x10, 0, _OBJ), (0x20, 5, _OBJ)]),
        ("named user refused even though other may", 0o700, [u_obj, (0x02, 0, uid), g_obj, (0x10, 7, _OBJ),
                                                             (0x20, 5, _OBJ)]),
    ]


def test_a_directorys_acl_decides_as_the_kernel_does_for_the_jobs_owner(tree):
    entry = pwd.getpwnam(USER)
    answers = []
    for what, mode, acl in _cases(entry.pw_uid, entry.pw_gid):
        d = tree / what.replace(" ", "-").replace(",", "").replace(":", "").replace("'", "")
        d.mkdir()
        os.chmod(d, mode)
        if acl:
            _set_acl(d, *acl)
        with reach.as_owner(USER):
            ours = reach.is_dir(str(d))
        assert ours == _kernel_says("x", d), what
        answers.append(ours)
    assert True in answers and False in answers  # the cases are not all one answer (a path closed above them)


def test_a_file_behind_a_directory_opened_by_acl_is_found_and_one_the_acl_closes_is_not(tree):
    entry = pwd.getpwnam(USER)
    project = tree / "project"
    project.mkdir()
    os.chmod(project, 0o700)  # by its mode bits, root's alone
    script = project / "train.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o700)
    u_obj, g_obj, other = (0x01, 7, _OBJ), (0x04, 0, _OBJ), (0x20, 0, _OBJ)
    _set_acl(project, u_obj, (0x02, 5, entry.pw_uid), g_obj, (0x10, 5, _OBJ), other)
    _set_acl(script, u_obj, (0x02, 5, entry.pw_uid), g_obj, (0x10, 5, _OBJ), other)
    with reach.as_owner(USER):
        assert reach.is_dir(str(project)) and reach.is_executable(str(script)) and reach.is_file(str(script))
        assert reach.which("train.sh", str(project), "/") == str(script)
    assert _kernel_says("x", script) and _kernel_says("r", script)
    # The mask closes it again: the check says so too, not the mode's group bits.
    _set_acl(script, u_obj, (0x02, 5, entry.pw_uid), g_obj, (0x10, 4, _OBJ), other)
    with reach.as_owner(USER):
        assert not reach.is_executable(str(script)) and reach.is_file(str(script))
    assert not _kernel_says("x", script) and _kernel_says("r", script)


def test_a_link_through_a_closed_directory_says_nothing_of_what_is_in_it(tree: Path):
    # The path was checked as written and as realpath gives it: a link through another user's 0700
    # directory and back out with `..` (or a link inside it) told whether a name there existed.
    private, public = tree / "private", tree / "public"
    (private / "project").mkdir(parents=True)
    private.chmod(0o700)
    public.mkdir()
    (public / "job.sh").write_text("echo hi\n")
    (public / "job.sh").chmod(0o755)
    (private / "inner").symlink_to(public / "job.sh")
    links = {"through_existing": f"{private}/project/../../public/job.sh",
             "through_missing": f"{private}/nothing/../../public/job.sh",
             "to_a_link_inside": f"{private}/inner"}
    for name, target in links.items():
        (tree / name).symlink_to(target)
    with reach.as_owner(USER):
        answers = {name: (reach.is_file(str(tree / name)), reach.is_executable(str(tree / name))) for name in links}
        assert answers == dict.fromkeys(links, (False, False)), answers
        assert reach.is_file(str(public / "job.sh"))  # the file itself, by a path the user may walk
    for name in links:  # as the kernel answers the user
        assert not _kernel_says("r", tree / name) and not _kernel_says("x", tree / name), name
    assert _kernel_says("r", public / "job.sh")
