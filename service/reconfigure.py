"""`gpuq reconfigure`: a running stack takes up an edited config file without a stop, as SLURM's
`scontrol reconfigure` has slurmctld and the slurmds read slurm.conf again.

The command sends the stack's supervisor SIGHUP. The supervisor reads the settings again, as its
children would (its environment from `gpuq up`, over the file), and, if they are valid and none of
those that make the stack what it is changed (``FIXED``), restarts its children on them: the server
and the scheduler at once (clients ride out a server's restart), each worker warm, once its running
job has ended (SIGINT: no new job starts there meanwhile, and no GPUQ_SHUTDOWN_GRACE cuts the job
short), so no job is stopped. Its answer, taken
or refused with the reason, goes to ``outcome_file``, which the command waits for and prints.

One settings edit thus reaches every process of the stack; before, each read the file only when it
started, so a server restarted after an edit and a scheduler that was not could disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gpuq.service.errors import StackError
from gpuq.service.settings import Settings

# The settings a running stack cannot take up: where its state, database, broker, socket and
# GPUs are, which its processes (Redis among them) were started on, and the heartbeat that the
# workers still on the old settings keep while the scheduler would judge them by the new.
FIXED = ("home", "database_url", "broker_url", "redis_port", "key_prefix", "node", "socket", "fake_gpus",
         "fake_gpu_memory_mib", "fake_gpu_memory_dir", "heartbeat_interval")
# How long the command waits for the supervisor's answer.
ANSWER_WITHIN = 15.0


@dataclass(frozen=True)
class Outcome:
    asked_at: float  # time.time() when the supervisor took the request
    taken: bool
    said: str  # what changed and what restarts, or why it was refused

    def to_json(self) -> str:
        return json.dumps({"asked_at": self.asked_at, "taken": self.taken, "said": self.said})


def outcome_file(settings: Settings) -> Path:
    return settings.run_dir / "reconfigured.json"


def fixed_changes(old: Settings, new: Settings) -> list[str]:
    """The ``FIXED`` settings that differ, by their variable's name."""
    return [f"GPUQ_{name.upper()}" for name in FIXED if getattr(old, name) != getattr(new, name)]


def changed(old: Settings, new: Settings) -> list[str]:
    """Every setting that differs, by its variable's name."""
    return [f"GPUQ_{f.name.upper()}" for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]


def write_outcome(settings: Settings, outcome: Outcome) -> None:
    path = outcome_file(settings)
    part = path.with_suffix(".part")
    part.write_text(outcome.to_json())
    part.replace(path)


def ask(settings: Settings, within: float = ANSWER_WITHIN) -> Outcome:
    """Ask this home's running supervisor to reconfigure; its answer. StackError where no stack of
    this home runs, or it does not answer ``within`` seconds."""
    from gpuq.service.stack import running_supervisor

    supervisor = running_supervisor(settings)
    if supervisor is None:
        raise StackError(f"gpuq is not up here (no supervisor of {settings.home}): nothing to reconfigure")
    asked = time.time()
    os.kill(supervisor.pid, signal.SIGHUP)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            found = json.loads(outcome_file(settings).read_text())
            if found["asked_at"] >= asked - 0.001:
                return Outcome(found["asked_at"], bool(found["taken"]), str(found["said"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not written yet, or being replaced
        time.sleep(0.05)
    raise StackError(f"the supervisor (pid {supervisor.pid}) did not answer within {within:g} s; "
                     f"see {settings.log_dir / 'supervisor.log'}")
