"""What a command job needs to start is checked when it is submitted, and again when it is
resubmitted: its directory, its program, and a script's #! line (service/spec.py `check_command`),
as its owner meets them (service/reach.py). A job that cannot start is one line and exit 2 now,
not a failure when it reaches a GPU."""

from __future__ import annotations

import json
import os
import pwd
import shutil

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service import launchable, reach, spec, submitting
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job
from gpuq.service.resubmit import resubmit

pytestmark = pytest.mark.timeout(60)

PATH = "/usr/local/bin:/usr/bin:/bin"


def invoke(args):
    return CliRunner().invoke(app, args, prog_name="gpuq")


def jobs_in(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def refused_in_one_line(result, message: str) -> None:
    assert result.exit_code == c.EXIT_USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuq: "), result.output
    assert message in lines[0], lines[0]


def submitted(args) -> int:
    result = invoke(["submit", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["id"]


def write(path, data: bytes | str, mode: int = 0o755):
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def check(argv, cwd, user: str | None = None, path: str = PATH) -> spec.JobSpec:
    with reach.as_owner(user or "root"):
        return spec.command_spec(argv, cwd=str(cwd), user=user, env={"PATH": path})


# --- bug 1: a resubmit makes a submit's checks ----------------------------------------------------

def test_resubmit_of_a_job_whose_script_was_removed_is_refused_like_its_submit(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path / "tmp.sh", "#!/bin/sh\ntrue\n")
    first = submitted(["--", "./tmp.sh"])
    assert invoke(["resubmit", str(first)]).exit_code == 0  # while it is there
    script.unlink()
    refused_in_one_line(invoke(["submit", "--", "./tmp.sh"]), "./tmp.sh is not an executable file")
    refused_in_one_line(invoke(["resubmit", str(first)]),
                        f"job {first} cannot run again: ./tmp.sh is not an executable file (from {tmp_path})")
    assert jobs_in(use_settings) == 2


def test_resubmit_of_a_job_whose_directory_was_removed_is_refused(use_settings, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    first = submitted(["--", "true"])
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(work)
    refused_in_one_line(invoke(["resubmit", str(first)]), f"working directory {work} does not exist")
    assert jobs_in(use_settings) == 1


def test_resubmit_checks_as_the_jobs_owner_not_as_the_root_server(settings, shared_dir):
    # Root's checks pass for every path: the job runs as nobody, who can no longer enter its directory.
    project = shared_dir / "project"
    project.mkdir(mode=0o755)
    write(project / "tool.sh", "#!/bin/sh\ntrue\n")
    with reach.as_owner("nobody"):
        job = submitting.submit(settings, spec.command_spec(["./tool.sh"], cwd=str(project), user="nobody",
                                                            env={"PATH": PATH}))
    assert resubmit(settings, job.id).user == "nobody"
    project.chmod(0o700)
    with pytest.raises(InvalidSpec, match=f"job {job.id} cannot run again: working directory .* closed to nobody"):
        resubmit(settings, job.id)
    project.chmod(0o755)
    (project / "tool.sh").chmod(0o744)  # root may run it; its owner may not
    with pytest.raises(InvalidSpec, match=r"\./tool\.sh is not an executable file .* or is closed to nobody"):
        resubmit(settings, job.id)
    assert jobs_in(settings) == 2


# --- bug 2: a script that can never start is refused at submit -------------------------------------

@pytest.mark.parametrize("content,message", [
    (b"#!/bin/sh\r\necho hi\r\n", "./job.sh: its #! line ends in a carriage return (Windows line endings), so it "
                                  "cannot start: convert it (dos2unix ./job.sh)"),
    (b"#!/usr/bin/env sh\r\necho hi\r\n", "its #! line ends in a carriage return"),
    (b"#!/opt/nope/python\nprint(1)\n", "./job.sh: its #! interpreter /opt/nope/python does not exist or is not "
                                        "executable"),
    (b"#!/etc/passwd\n", "its #! interpreter /etc/passwd does not exist or is not executable"),
    (b"echo hi\n", "./job.sh has no #! line, and gpuq runs it without a shell: add #!/bin/sh or similar"),
    (b"", "./job.sh has no #! line"),
    (b"#!\necho hi\n", "./job.sh: its #! line names no interpreter"),
    (b"#!/usr/bin/env no-such-program-gpuq\n", "runs no-such-program-gpuq through env, and no-such-program-gpuq "
                                               "is not on the job's PATH"),
    # The kernel gives env "sh -e" as one word: env looks for a program of that name.
    (b"#!/usr/bin/env sh -e\n", "./job.sh: its #! line gives env 'sh -e' as one word (the kernel does not split "
                                "it), so it cannot start: write #!/usr/bin/env -S sh -e"),
])
def test_a_script_that_cannot_start_is_refused(tmp_path, content, message):
    write(tmp_path / "job.sh", content)
    with pytest.raises(InvalidSpec) as refused:
        check(["./job.sh"], tmp_path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("content", [
    b"#!/bin/sh\necho hi\n",
    b"#! /bin/sh -e\n",
    b"#!\t/bin/sh\n",
    b"#!/usr/bin/env sh\n",
    b"#!/usr/bin/env -S sh -e\n",
    b"#!/bin/sh\n#GPUQ --gpus 2 --time 30m\necho hi\r\n",  # a carriage return past the first line is the shell's
    b"#!/bin/sh" + b" " * 300 + b"\n",  # longer than the kernel reads: left to it
    b"MZ\x90\x00\x03\x00binary of another format",  # binfmt_misc may run it
])
def test_a_script_that_can_start_is_accepted(tmp_path, content):
    write(tmp_path / "job.sh", content)
    assert check(["./job.sh"], tmp_path).argv == ["./job.sh"]


def test_a_binary_and_a_program_on_path_are_read_and_checked_too(tmp_path):
    shutil.copy("/bin/true", tmp_path / "prog")
    assert check(["./prog"], tmp_path).argv == ["./prog"]
    assert check(["true"], tmp_path).argv == ["true"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write(bin_dir / "crlf-tool", b"#!/bin/sh\r\n")
    with pytest.raises(InvalidSpec, match="crlf-tool: its #! line ends in a carriage return"):
        check(["crlf-tool"], tmp_path, path=f"{bin_dir}:{PATH}")


def test_a_relative_path_entry_is_the_jobs_directory_not_the_servers(tmp_path, monkeypatch):
    # As the worker's exec finds it: PATH=bin:... is looked up from the job's directory.
    job_dir, elsewhere = tmp_path / "job", tmp_path / "server"
    for where in (job_dir / "bin", elsewhere / "bin"):
        where.mkdir(parents=True)
    write(job_dir / "bin" / "crlf-tool", b"#!/bin/sh\r\n")
    write(elsewhere / "bin" / "crlf-tool", "#!/bin/sh\ntrue\n")
    write(elsewhere / "bin" / "only-there", "#!/bin/sh\ntrue\n")
    monkeypatch.chdir(elsewhere)  # the server's own directory holds a good one of each
    with pytest.raises(InvalidSpec, match="crlf-tool: its #! line ends in a carriage return"):
        check(["crlf-tool"], job_dir, path=f"bin:{PATH}")
    with pytest.raises(InvalidSpec, match="command not found: only-there"):
        check(["only-there"], job_dir, path=f"bin:{PATH}")
    write(job_dir / "tool", "#!/bin/sh\ntrue\n")
    assert check(["tool"], job_dir, path=f":{PATH}").argv == ["tool"]  # an empty entry: the directory itself


@pytest.mark.skipif(os.geteuid() != 0, reason="the check reads as root for another user only when root")
def test_a_link_flipped_to_a_closed_file_between_the_check_and_the_open_is_not_read(shared_dir, monkeypatch):
    # The security audit's race: ./prog flipped between a good script and a file behind another
    # user's 0700 directory; the #! line of the closed file came back in the refusal.
    closed = shared_dir / "closed"
    closed.mkdir(mode=0o700)
    write(closed / "secret.sh", "#!/SECRET-TOKEN\ntrue\n", 0o644)
    write(shared_dir / "ok.sh", "#!/nonexistent-interp\ntrue\n")
    prog = shared_dir / "prog"
    prog.symlink_to(shared_dir / "ok.sh")
    real_open = launchable.os.open

    def flip_then_open(path, *args, **kwargs):  # the swap lands between the walk and the open
        if str(path).endswith("/prog"):
            prog.unlink()
            prog.symlink_to(closed / "secret.sh")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(launchable.os, "open", flip_then_open)
    try:  # accepted (what the owner cannot read is the kernel's to judge at exec), or refused: not leaked
        check(["./prog"], shared_dir, user="nobody")
    except InvalidSpec as refused:
        assert "SECRET" not in str(refused), refused


def test_a_file_its_owner_may_not_read_is_not_read_for_them(shared_dir):
    # Execute-only: the kernel runs a binary so; root reads it, but what it says is not nobody's to learn.
    for name, content in (("noline", b"echo hi\n"), ("crlf", b"#!/bin/sh\r\n"), ("nope", b"#!/opt/nope/x\n")):
        program = write(shared_dir / name, content, 0o711)
        assert check([f"./{name}"], shared_dir, user="nobody").argv == [f"./{name}"]
        program.chmod(0o755)
        with pytest.raises(InvalidSpec, match=f"./{name}"):
            check([f"./{name}"], shared_dir, user="nobody")


def test_an_interpreter_closed_to_the_owner_is_refused_for_them(shared_dir):
    closed = shared_dir / "closed"
    closed.mkdir(mode=0o700)
    write(closed / "interp", "#!/bin/sh\nexec /bin/sh \"$@\"\n")
    write(shared_dir / "job.sh", f"#!{closed}/interp\ntrue\n")
    assert check(["./job.sh"], shared_dir).argv == ["./job.sh"]  # root's own job
    with pytest.raises(InvalidSpec, match=f"its #! interpreter {closed}/interp does not exist or is not "
                                          "executable or is closed to nobody"):
        check(["./job.sh"], shared_dir, user="nobody")


def test_the_workers_diagnosis_of_a_failed_start_reads_no_line_closed_to_the_owner(shared_dir):
    # The root worker explains an exec that failed (ENOENT) by the script's #! line: a link flipped
    # after the exec to a file of root's had its first word read as root and named to the user.
    from gpuq.workers.command import _why_not_started
    from gpuq.workers.identity import Identity

    closed = shared_dir / "closed"
    closed.mkdir(mode=0o700)
    secret = write(closed / "tool", "#!/opt/root-only/secret-interp\ntrue\n")
    gone = FileNotFoundError(2, "No such file or directory")
    e = pwd.getpwnam("nobody")
    nobody = Identity(name=e.pw_name, uid=e.pw_uid, gid=e.pw_gid, groups=(e.pw_gid,), home=e.pw_dir, shell=e.pw_shell)
    why, code = _why_not_started(gone, str(secret), str(shared_dir), nobody)
    assert code == 127 and "secret-interp" not in why, why
    assert why.endswith("no such file or command (it was there at submit)")
    # The same for a job of the worker's own user: its line is theirs to read.
    why, _ = _why_not_started(gone, str(secret), str(shared_dir), None)
    assert why == f"{secret}: its interpreter /opt/root-only/secret-interp is not found"
    # A directory the owner may not enter reads as gone to them.
    why, code = _why_not_started(gone, "./x", str(closed), nobody)
    assert (why, code) == (f"its directory {closed} is gone (it was there at submit)", 126)


def test_may_read_answers_for_the_open_file_by_its_owners_rights(shared_dir):
    secret = write(shared_dir / "secret", "x", 0o600)
    with open(secret, "rb") as f, reach.as_owner("nobody"):
        assert not reach.may_read(f.fileno())
        secret.chmod(0o644)
        assert reach.may_read(f.fileno())


@pytest.mark.parametrize("content,message", [
    (b"#!/bin/sh\r\necho hi\r\n", "its #! line ends in a carriage return (Windows line endings)"),
    (b"#!/opt/nope/python\n", "its #! interpreter /opt/nope/python does not exist"),
    (b"echo hi\n", "./job.sh has no #! line, and gpuq runs it without a shell"),
])
def test_gpuq_submit_and_resubmit_refuse_a_script_that_cannot_start_in_one_line(use_settings, tmp_path,
                                                                                 monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path / "job.sh", "#!/bin/sh\n#GPUQ --name from-script\necho hi\n")
    first = submitted(["--", "./job.sh"])
    write(script, content)
    refused_in_one_line(invoke(["submit", "--", "./job.sh"]), message)
    refused_in_one_line(invoke(["resubmit", str(first)]), message)
    assert jobs_in(use_settings) == 1
