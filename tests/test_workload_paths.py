"""A built-in workload's paths and files as its job's owner means them: relative paths from the
job's working directory and ``~`` in the owner's home (never the server's), and the files it
writes made with the submitter's umask, an existing file keeping its mode."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile

import pytest

from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec
from gpuq.service.spec import workload_spec
from gpuq.service.workloads import get_workload
from gpuq.workers.identity import Identity
from gpuq.workers.owner_files import OwnerFileError, OwnerFiles, umask_of

pytestmark = pytest.mark.timeout(30)

CHECKPOINT = get_workload("train").param("checkpoint")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The process (the server) in one directory with a $HOME of its own; the job's directory apart."""
    server = tmp_path / "server"
    job = tmp_path / "job"
    server.mkdir()
    job.mkdir()
    monkeypatch.chdir(server)
    monkeypatch.setenv("HOME", str(server))
    return server, job


def test_a_relative_path_is_resolved_in_the_jobs_directory_not_the_servers(elsewhere):
    server, job = elsewhere
    assert CHECKPOINT.parse("ck.pt", cwd=str(job), owner="root") == str(job / "ck.pt")
    assert CHECKPOINT.parse("../job/./a/b.pt", cwd=str(job), owner="root") == str(job / "a" / "b.pt")
    spec = workload_spec("train", ["--epochs", "1", "--checkpoint", "ck.pt"], cwd=str(job), user="root")
    assert spec.params["checkpoint"] == str(job / "ck.pt") and str(server) not in spec.params["checkpoint"]
    (job / "data").mkdir()
    with pytest.raises(InvalidSpec) as refused:
        workload_spec("train", ["--data-dir", "data"], cwd=str(job), user="root")
    # Checked where the job will look (it lacks the IDX files there), and the server's directory is not named.
    assert f"--data-dir {job}/data lacks" in str(refused.value) and str(server) not in str(refused.value)


def test_an_absolute_path_stays_as_given(elsewhere):
    _, job = elsewhere
    assert CHECKPOINT.parse("/srv/runs/ck.pt", cwd=str(job), owner="root") == "/srv/runs/ck.pt"


def test_a_tilde_is_the_owners_home_not_the_servers(elsewhere):
    server, job = elsewhere
    root_home = pwd.getpwnam("root").pw_dir
    nobody_home = pwd.getpwnam("nobody").pw_dir
    assert CHECKPOINT.parse("~/ck.pt", cwd=str(job), owner="nobody") == os.path.join(nobody_home, "ck.pt")
    assert CHECKPOINT.parse("~", cwd=str(job), owner="nobody") == os.path.abspath(nobody_home)
    assert CHECKPOINT.parse("~root/ck.pt", cwd=str(job), owner="nobody") == os.path.join(root_home, "ck.pt")
    spec = workload_spec("train", ["--epochs", "1", "--checkpoint", "~/ck.pt"], cwd=str(job), user="root")
    assert spec.params["checkpoint"] == os.path.join(root_home, "ck.pt") != str(server / "ck.pt")


def test_a_tilde_of_no_known_user_is_refused(elsewhere):
    _, job = elsewhere
    with pytest.raises(InvalidSpec, match="no user gpuq-no-such-user here"):
        CHECKPOINT.parse("~gpuq-no-such-user/ck.pt", cwd=str(job), owner="root")
    with pytest.raises(InvalidSpec, match="uid4242424 has no home directory here"):
        CHECKPOINT.parse("~/ck.pt", cwd=str(job), owner="uid4242424")


def test_the_server_resolves_a_submits_paths_in_its_cwd_and_keeps_its_umask(elsewhere):
    from gpuq.server import submission

    server, job = elsewhere
    body = {"workload": "train", "args": ["--epochs", "1", "--checkpoint", "ck.pt"], "cwd": str(job),
            "umask": 0o077}
    [made] = submission._specs_of(submission._fields(body), "root")
    assert made.params["checkpoint"] == str(job / "ck.pt") and made.cwd == str(job)
    # In the job's environment, as a command's: no parameter of the workload's.
    assert made.env == {c.UMASK_VARIABLE: "0077"} and umask_of(made.env) == 0o077
    assert "umask" not in made.params
    [none] = submission._specs_of(submission._fields(body | {"umask": None}), "root")
    assert none.env == {} and umask_of(none.env) is None


@pytest.mark.parametrize(("env", "mask"), [({c.UMASK_VARIABLE: "0027"}, 0o027), ({}, None), (None, None),
                                           ({c.UMASK_VARIABLE: "999"}, None), ({c.UMASK_VARIABLE: "1777"}, None)])
def test_a_jobs_umask_is_read_from_its_environment(env, mask):
    assert umask_of(env) == mask


def test_owner_files_make_a_new_file_with_the_jobs_umask(tmp_path):
    old = os.umask(0o022)
    try:
        OwnerFiles(umask=0o077).write(str(tmp_path / "ck.pt"), b"one")
        OwnerFiles(umask=0o027).write(str(tmp_path / "g.pt"), b"one")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "ck.pt") == 0o600 and (tmp_path / "ck.pt").read_bytes() == b"one"
    assert _mode(tmp_path / "g.pt") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "g.pt"]  # no temporary file left


def test_owner_files_keep_an_existing_files_mode(tmp_path):
    path = tmp_path / "ck.pt"
    path.write_bytes(b"one")
    path.chmod(0o600)
    OwnerFiles().write(str(path), b"two")
    assert _mode(path) == 0o600 and path.read_bytes() == b"two"
    path.chmod(0o664)
    OwnerFiles(umask=0o077).write(str(path), b"three")
    assert _mode(path) == 0o664 and path.read_bytes() == b"three"


@pytest.fixture
def nobodys_dir():
    """A directory under /tmp that the user nobody may write in (pytest's tmp_path is root's only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the files are written as another user")
    top = tempfile.mkdtemp(prefix="gpuq-owner-files-", dir="/tmp")
    os.chmod(top, 0o777)
    try:
        yield top
    finally:
        shutil.rmtree(top)


def _nobody() -> Identity:
    e = pwd.getpwnam("nobody")
    return Identity(name=e.pw_name, uid=e.pw_uid, gid=e.pw_gid, groups=(e.pw_gid,), home=e.pw_dir, shell=e.pw_shell)


def test_owner_files_as_the_owner_honour_the_umask_and_keep_the_mode(nobodys_dir):
    files = OwnerFiles(_nobody(), umask=0o077)
    new = os.path.join(nobodys_dir, "ck.pt")
    files.write(new, b"one")
    assert _mode(new) == 0o600 and os.stat(new).st_uid == pwd.getpwnam("nobody").pw_uid
    os.chmod(new, 0o640)
    files.write(new, b"two")
    assert _mode(new) == 0o640 and files.read(new) == b"two"
    # Without a umask of the job's: 022, as before.
    other = os.path.join(nobodys_dir, "old.pt")
    OwnerFiles(_nobody()).write(other, b"x")
    assert _mode(other) == 0o644
    assert sorted(os.listdir(nobodys_dir)) == ["ck.pt", "old.pt"]


def test_owner_files_refuse_a_file_past_the_cap_after_reading_one_byte_past_it(tmp_path):
    big = tmp_path / "big.pt"
    big.write_bytes(b"x" * 2048)
    assert OwnerFiles().read(str(big), limit=2048) == b"x" * 2048
    with pytest.raises(OwnerFileError, match="larger than"):
        OwnerFiles().read(str(big), limit=1024)
    # A device that never ends (a path to /dev/zero in --checkpoint) ends at the cap too.
    with pytest.raises(OwnerFileError, match="larger than"):
        OwnerFiles().read("/dev/zero", limit=1 << 20)


def test_owner_files_as_the_owner_stop_at_the_cap(nobodys_dir):
    files = OwnerFiles(_nobody())
    with pytest.raises(OwnerFileError, match="larger than"):
        files.read("/dev/zero", limit=1 << 20)
    small = os.path.join(nobodys_dir, "small.pt")
    files.write(small, b"abc")
    assert files.read(small, limit=3) == b"abc"
    assert files.read(os.path.join(nobodys_dir, "none.pt")) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="checks as another user")
def test_a_checkpoint_in_a_directory_its_owner_cannot_write_is_refused_at_submit(tmp_path):
    # It trained, then failed at its first save (Permission denied as the owner).
    from gpuq.service import reach

    top = tempfile.mkdtemp(prefix="gpuqt-ck-")
    try:
        os.chmod(top, 0o755)  # root's, open to read: nobody may not make files in it
        with reach.as_owner("nobody"), pytest.raises(InvalidSpec, match=f"directory {top} is not writable by nobody"):
            workload_spec("train", ["--checkpoint", f"{top}/ck.pt"], cwd=top, user="nobody")
        os.chmod(top, 0o777)
        with reach.as_owner("nobody"):
            assert workload_spec("train", ["--checkpoint", f"{top}/ck.pt"], cwd=top, user="nobody")
    finally:
        shutil.rmtree(top, ignore_errors=True)
