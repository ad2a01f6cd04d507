"""Admin commands (`drain`, `resume`, `db`, `scheduler`, `worker`, `server`, `up`, `down`) open gpuq's
database themselves. Run by an ordinary user of root's machine stack they stop in one line, exit
77, with nothing opened or written, rather than fail on a database of the user's own making; a
user's own stack, beside root's, is still theirs to start, steer and stop."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from gpuq.migrations.versions import HEAD
from gpuq.service.db import write_scope
from gpuq.service.node_drains import drained_nodes
from tests import test_multiuser as multiuser
from tests.conftest import free_port
from tests.test_audit import logged

pytestmark = [multiuser.pytestmark, pytest.mark.timeout(300)]

box = multiuser.box  # root's `gpuq up` stack and two OS users (tests/test_multiuser.py)

# Each admin command with the arguments it needs (NODE: the stack's node); none may get as far as running.
COMMANDS = [("drain", "NODE", "--reason", "mine now"), ("resume", "NODE"), ("retire", "NODE"), ("reconfigure",),
            ("db", "upgrade"),
            ("db", "current"),
            ("scheduler",), ("worker", "--gpu", "0"), ("server",)]


def _commands(box: multiuser.Box) -> list[tuple[str, ...]]:
    return [tuple(box.settings.node if a == "NODE" else a for a in args) for args in COMMANDS]


def _files_under(path: str) -> list[str]:
    return sorted(str(Path(root) / name) for root, dirs, files in os.walk(path) for name in [*dirs, *files])


def _drained(box: multiuser.Box) -> dict:
    with write_scope(box.settings) as session:
        return drained_nodes(session)


def test_admin_commands_on_roots_database_are_refused_in_one_line_naming_it_with_nothing_written(box):
    # A user whose settings name root's home (a copied config, GPUQ_HOME): its database is root's.
    env = {**box.user_env(box.a), "GPUQ_HOME": str(box.settings.home)}
    database = box.settings.home / "gpuq.db"
    home, drained = _files_under(box.home_of(box.a)), _drained(box)
    for args in [*_commands(box), ("up", "--timeout", "30"), ("down",)]:
        name = " ".join(args[:2]) if args[0] == "db" else args[0]
        line = multiuser._refused(box.as_user(box.a, multiuser.GPUQ, *args, env=env))
        does = {"down": "stops the stack that keeps gpuq's database",
                "reconfigure": "restarts the stack that keeps gpuq's database"}.get(name, "opens gpuq's database")
        assert line == (f"gpuq: gpuq {name} is an admin command: it {does}, which only root and gpuq's own "
                        f"services can read ({database})"), line
    assert _files_under(box.home_of(box.a)) == home and _drained(box) == drained
    assert multiuser._mode(database) == 0o600


def test_admin_commands_of_a_user_with_no_database_name_the_root_stack_they_use_and_make_no_database(box):
    # No settings but the socket, as every user of root's stack: the database these would open is
    # one of the user's own, which does not exist; the queue they use is root's.
    drained = _drained(box)
    for args in _commands(box):
        name = " ".join(args[:2]) if args[0] == "db" else args[0]
        line = multiuser._refused(box.gpuq(box.b, *args))
        does = "restarts the stack that keeps gpuq's database" if name == "reconfigure" else "opens gpuq's database"
        assert line == (f"gpuq: gpuq {name} is an admin command: it {does}, and the queue you use "
                        f"(the server at {box.socket}) is root's, whose database only root and gpuq's own services "
                        "can read"), line
    assert not Path(box.home_of(box.b), ".local", "share", "gpuq").exists()  # no database made
    assert _drained(box) == drained
    # `gpuq down` has nothing of theirs to stop, and says whose stack stays up.
    down = box.gpuq(box.b, "down")
    assert down.returncode == 0 and down.stdout.strip() == (
        f"gpuq was not up (no stack of yours; the server at {box.socket} is root's and stays up)"), down
    # Root's own are not refused: root drains and resumes its node, and the server's audit trail
    # has both, with the admin sudo let in.
    node = box.settings.node
    for args, says in ((("drain", node, "--reason", "fan swap"), "drained"), (("resume", node), "resumed")):
        done = multiuser._run([multiuser.GPUQ, *args], env={**box.env, "SUDO_USER": "labadmin"})
        assert done.returncode == 0 and says in done.stdout, done.stderr
    log = box.settings.log_dir / "server.log"
    logged(log, f"drain by labadmin via sudo (uid 0): node {node} (reason: fan swap)")
    logged(log, f"resume by labadmin via sudo (uid 0): node {node}")


def test_a_users_own_stack_beside_roots_still_starts_and_its_admin_commands_steer_it(box):
    # The user's client talks to root's server (GPUQ_SERVER); `gpuq up` starts a stack of their own
    # on a socket and home of their own, and drain, resume and down act on that one.
    user = box.a
    home = Path(box.home_of(user)) / f"gpuq-own-{uuid.uuid4().hex[:6]}"
    env = {**box.user_env(user), "GPUQ_SERVER": box.socket, "GPUQ_HOME": str(home),
           "GPUQ_SOCKET": f"/tmp/gpuqown-{uuid.uuid4().hex[:6]}.sock", "GPUQ_REDIS_PORT": str(free_port()),
           "GPUQ_FAKE_GPUS": "1", "GPUQ_NODE": "own", "GPUQ_WARM_START": "false", "GPUQ_SAMPLE_INTERVAL": "0",
           "GPUQ_HEARTBEAT_INTERVAL": "0.5", "GPUQ_SCHEDULER_INTERVAL": "0.5",
           "GPUQ_CONFIG": "/nonexistent/gpuq-test.toml"}

    def gpuq(*args: str, timeout: float = 60):
        return box.as_user(user, multiuser.GPUQ, *args, env=env, timeout=timeout)

    up = gpuq("up", "--timeout", "150", timeout=200)
    try:
        assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{multiuser._logs(home / 'logs')}"
        for args, says in ((("drain", "own", "--reason", "mine"), "node own drained"), (("resume", "own"), "resumed"),
                           (("db", "current"), HEAD)):
            done = gpuq(*args)
            assert done.returncode == 0 and says in done.stdout, (args, done.stdout, done.stderr)
        assert "own" not in _drained(box)  # root's queue never heard of it
        down = gpuq("down", "--grace", "5", timeout=120)
        assert down.returncode == 0 and down.stdout.strip() == "gpuq is down", down.stderr
        # Their stack down, its database left: drain steered that one, said "drained", and root's
        # queue, the one their client uses, ran on.
        line = multiuser._refused(gpuq("drain", "vm"))
        assert "the queue you use (the server at " in line and "is root's" in line, line
    finally:
        gpuq("down", "--grace", "5", timeout=120)
        Path(env["GPUQ_SOCKET"]).unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)
