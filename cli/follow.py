"""Following one job in the terminal, as srun and `ts -f` do: `gpuq run` (queue it, then follow it)
and `gpuq attach` (follow a job already queued or running).

While the job waits, one line on stderr says why (updated in place on a terminal). Once it runs,
its stdout goes to stdout and its stderr to stderr as the worker stores them (every half second at
most), and the command exits with the job's own exit code, or with gpuq's code for an end that gpuq
made (constants.EXIT_RUN_*). The server answers each request as soon as there is news, so a
follower costs one request per batch of output, not a poll many times a second.

Ctrl-C during `gpuq run` cancels the job and waits for it to stop (a second Ctrl-C leaves at once);
a closed terminal (SIGHUP) or SIGTERM cancels it and leaves, and so does a reader of its output that
went away (`gpuq run ... | head`: srun dies of the SIGPIPE, and its step with it), with 141. `gpuq
attach` leaves on any of them, and the job goes on. A `gpuq run` killed outright ends its job too,
later: it keeps the job alive while it follows it (cli/keep_alive.py).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import FrameType
from typing import Annotated, Any, TextIO

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client, Refused
from gpuq.cli.render import result_lines
from gpuq.service import constants as c
from gpuq.service.constants import State

app = typer.Typer()

# While a job waits, the line is asked for again this often (its reason may change meanwhile).
WAITING_LOOK_SECONDS = 2.0
# gpuq's own ends: the failure classes that are not the job's doing.
GPUQ_ENDS = (*c.INFRA_FAILURES, c.FAILURE_CLIENT_LOST, c.FAILURE_GPU_MEM_EXCEEDED, c.FAILURE_PREEMPTED)


class HangUp(Exception):
    """The terminal closed (SIGHUP), or the client was asked to stop (SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """A shell's code for a process ended by that signal: 129 for SIGHUP, 143 for SIGTERM."""
        return 128 + self.signum


class ReaderGone(Exception):
    """Where the job's output goes was closed (a broken pipe: `gpuq run ... | head` once head has
    its lines). Left as a shell reports a process SIGPIPE killed: 141."""

    exit_code = 128 + signal.SIGPIPE

    def __str__(self) -> str:
        return "its output's reader is gone (broken pipe)"


def exit_code_of(end: dict[str, Any]) -> int:
    """The code `gpuq run` exits with for a job's end (the output route's answer once it ended).

    A cancel is `gpuq wait`'s code for a job that did not succeed (EXIT_JOB_FAILED): `gpuq cancel`
    from elsewhere, or a dependency that failed. 130 is a shell's Ctrl-C, and `follow` gives it
    only for the interrupt typed in its own terminal."""
    state, failure, code = end["state"], end.get("failure"), end.get("exit_code")
    if state == State.SUCCEEDED:
        return 0
    if state == State.TIMED_OUT:
        return c.EXIT_RUN_TIMED_OUT
    if failure in GPUQ_ENDS:  # before a cancel: a preemption without requeue ends the job cancelled
        return c.EXIT_RUN_GPUQ
    if state == State.CANCELLED or failure == c.FAILURE_CANCELLED:
        return c.EXIT_JOB_FAILED
    if code is None:
        return 1  # a built-in workload that raised
    return 128 - code if code < 0 else min(code, 255) or 1


def end_line(job_id: int, end: dict[str, Any]) -> str | None:
    """What to say on stderr about a job's end; None when its exit code says it all (it succeeded,
    or its command exited non-zero on its own)."""
    state, failure = end["state"], end.get("failure")
    if state == State.SUCCEEDED or (failure == c.FAILURE_EXIT and (end.get("exit_code") or 0) > 0):
        return None
    what = failure if failure and failure != state else state
    reason = end.get("reason") or ""
    if state == State.CANCELLED and reason.startswith("cancelled "):  # once, not "cancelled: cancelled by user"
        return f"gpuq: job {job_id} {reason}"
    return f"gpuq: job {job_id} {state}" + (f" [{what}]" if what != state else "") + (f": {reason}" if reason else "")


# A waiting job's reason (policy's REASON words), as the end of "queued and waiting for ...".
_WAITS_FOR = {"resources": "resources", "priority": "jobs ahead of it (priority)",
              "dependency": "the jobs it depends on", "user limit": "its user's jobs to free GPUs (user limit)",
              "held": "a release: it is held (gpuq release {id})", "node drained": "its node to be resumed (drained)",
              "node draining": "its nodes' maintenance to end (node draining: `gpuq why {id}`)",
              "array limit": "its array's running tasks to end (array limit)",
              "begin time": "its --begin time (begin time)",
              "preempting": "the preemptible jobs on its GPUs to stop (preempting)"}


class Waiting:
    """The line on stderr that says why a job waits: rewritten in place on a terminal, a new line
    each time it changes elsewhere (a log file keeps every one)."""

    def __init__(self, job_id: int, stream: TextIO = sys.stderr) -> None:
        self.job_id, self.stream = job_id, stream
        self.tty = stream.isatty()
        self.shown = ""

    def show(self, state: str, reason: str | None, node: str | None = None) -> None:
        if state == State.PENDING:
            why = _WAITS_FOR.get(reason or "", reason or "its first scheduling pass")
            text = f"gpuq: job {self.job_id} queued and waiting for {why}".replace("{id}", str(self.job_id))
        elif self.tty:
            text = f"gpuq: job {self.job_id} starting" + (f" on {node}" if node else "")
        else:
            return  # placed, its message on its way: news on a terminal, noise in a log
        if text == self.shown:
            return
        self.shown = text
        say(self.stream, ("\r\033[K" + text) if self.tty else text + "\n")

    def clear(self) -> None:
        if self.shown and self.tty:
            say(self.stream, "\r\033[K")
        self.shown = ""


def say(stream: TextIO, text: str) -> None:
    """Write gpuq's own ``text`` to ``stream`` now; nothing if the terminal or the pipe is gone."""
    try:
        stream.write(text)
        stream.flush()
    except OSError:  # the terminal is gone (a hang-up): nothing to tell it
        pass


def put(stream: TextIO, data: str) -> None:
    """Write the job's own output ``data`` to ``stream`` now: as ``say``, but a pipe whose reader
    left (`| head`) raises ReaderGone, which ends the following."""
    try:
        stream.write(data)
        stream.flush()
    except BrokenPipeError:
        raise ReaderGone() from None  # the follower says so on stderr, then ``quiet``
    except OSError:
        pass


def quiet() -> None:
    """Point stdout and stderr at /dev/null: what is left in their buffers, and the interpreter's
    flush at exit, then go nowhere instead of failing on a closed pipe or terminal (which turned
    the exit code into Python's 120, or 1, and printed a traceback of the flush)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):
                pass
    finally:
        os.close(devnull)


def _hang_up(signum: int, frame: FrameType | None) -> None:
    raise HangUp(signum)


@contextmanager
def _handled(handler: Callable[[int, FrameType | None], None],
             signals: tuple[int, ...] = (signal.SIGHUP, signal.SIGTERM)) -> Iterator[None]:
    """``handler`` for ``signals`` meanwhile; the handlers before it afterwards."""
    before = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, previous in before.items():
            signal.signal(s, previous)


def hang_up_raises() -> AbstractContextManager[None]:
    """SIGHUP and SIGTERM raise HangUp in the main thread meanwhile (Ctrl-C raises KeyboardInterrupt)."""
    return _handled(_hang_up)


def leaving() -> AbstractContextManager[None]:
    """Signals that would end this client are let pass while it leaves on one: a closed ssh session
    sends SIGHUP then SIGTERM, and the second, raised as it said why it left, was a traceback."""
    return _handled(_let_pass, (signal.SIGHUP, signal.SIGTERM, signal.SIGINT))


def _let_pass(signum: int, frame: FrameType | None) -> None:
    """It is already leaving."""


def follow(client: Client, job_id: int, *, cancel_on_interrupt: bool, detach: bool = False) -> int:
    """Follow job ``job_id`` to its end; returns the exit code for it (``exit_code_of``).

    ``cancel_on_interrupt``: Ctrl-C cancels the job and waits for its end (a second one leaves at
    once), SIGHUP and SIGTERM cancel it and leave; otherwise they leave and the job goes on.
    ``detach``: leave as soon as the job runs."""
    waiting = Waiting(job_id)
    seq, state = -1, None
    cancelling = False
    open_line = False  # the job's output so far ends inside a line: gpuq's own words start a new one
    with hang_up_raises():
        while True:
            try:
                wait = WAITING_LOOK_SECONDS if state in (None, State.PENDING, State.DISPATCHED) else \
                    c.FOLLOW_WAIT_SECONDS
                # A server that restarts meanwhile is waited for (client.RIDE_OUT_SECONDS): the job goes on.
                answer = client.get(f"/jobs/{job_id}/output", ride_out=True, after=seq, wait=wait, state=state)
                state = answer["state"]
                if state in (State.PENDING, State.DISPATCHED):
                    waiting.show(state, answer["reason"])
                    continue
                waiting.clear()
                for _, data, stream in answer["chunks"]:
                    put(sys.stderr if stream == c.STDERR else sys.stdout, data)
                    open_line = bool(data) and not data.endswith("\n")
                seq = answer["chunks"][-1][0] if answer["chunks"] else seq
                if state in c.END_STATES and not answer["chunks"]:
                    return _ended(job_id, answer, interrupted=cancelling, open_line=open_line)
                if detach and state == State.RUNNING:
                    say(sys.stderr, f"gpuq: job {job_id} is running; `gpuq attach {job_id}` follows it, "
                                    f"`gpuq cancel {job_id}` stops it\n")
                    return 0
            except KeyboardInterrupt:
                waiting.clear()
                if not cancel_on_interrupt:
                    say(sys.stderr, f"\ngpuq: left job {job_id}; it goes on (`gpuq attach {job_id}`)\n")
                    return c.EXIT_RUN_CANCELLED
                if cancelling:
                    say(sys.stderr, f"\ngpuq: left job {job_id} while it stops\n")
                    return c.EXIT_RUN_CANCELLED
                cancelling = True
                say(sys.stderr, f"\ngpuq: cancelling job {job_id} (Ctrl-C again to leave without waiting)\n")
                sent, late = _cancel(client, job_id)
                if late is not None:  # the terminal closed meanwhile: the cancel went, and so do we
                    say(sys.stderr, f"\ngpuq: {late}: cancelled job {job_id}\n")
                    return late.exit_code
                if not sent:
                    return c.EXIT_RUN_CANCELLED
            except (HangUp, ReaderGone) as hung:
                with leaving():
                    waiting.clear()
                    if state in c.END_STATES:
                        pass  # ended: nothing left to cancel or leave
                    elif cancel_on_interrupt:
                        _cancel(client, job_id)
                        say(sys.stderr, f"\ngpuq: {hung}: cancelled job {job_id}\n")  # nowhere if the terminal is gone
                    else:
                        say(sys.stderr, f"\ngpuq: {hung}: left job {job_id}; it goes on (`gpuq attach {job_id}`)\n")
                    quiet()  # nothing more is read there: the exit's flush must not fail on it
                    return hung.exit_code


def _cancel(client: Client, job_id: int) -> tuple[bool, HangUp | None]:
    """Ask for the job's cancel, through a server restart too (a cancel is safe to ask twice).
    Whether it was sent (False: a second Ctrl-C came meanwhile), and the hang-up that came
    meanwhile, if one did: a closed ssh session sends SIGHUP then SIGTERM, and the second, raised
    inside the request, left a traceback and the job running. Now the request is seen through."""
    late: list[int] = []
    sent = True
    with _handled(lambda signum, _: late.append(signum)):
        try:
            client.post(f"/jobs/{job_id}/cancel", ride_out=True)
        except Refused as exc:
            if exc.exit_code != c.EXIT_CONFLICT:  # ended meanwhile: its end is what we report
                raise
        except KeyboardInterrupt:
            sent = False
    return sent, HangUp(late[0]) if late else None


def _ended(job_id: int, end: dict[str, Any], interrupted: bool = False, open_line: bool = False) -> int:
    """Say how the job ended and return its exit code; ``interrupted``: this terminal's Ctrl-C
    asked for its cancel, so a cancelled end is the user's own interrupt (130); ``open_line``: the
    job's output ended inside a line, which gpuq's words must not be glued to."""
    put(sys.stdout, "")
    result = end.get("kind") == c.KIND_WORKLOAD and end.get("result")
    line = end_line(job_id, end)
    if open_line and result:
        put(sys.stdout, "\n")
    elif open_line and line:
        say(sys.stderr, "\n")
    if result:
        put(sys.stdout, "\n".join(result_lines(end["result"])) + "\n")
    if line:
        say(sys.stderr, line + "\n")
    if interrupted and end["state"] == State.CANCELLED:
        return c.EXIT_RUN_CANCELLED
    return exit_code_of(end)


@app.command()
def attach(job_id: Annotated[int, typer.Argument(help="The job's id.", parser=numbers.job_id)]) -> None:
    """Follow a job's output from its start to its end, stdout and stderr apart, and exit with its
    status as `gpuq run` does. Ctrl-C leaves it running."""
    raise typer.Exit(follow(Client(), job_id, cancel_on_interrupt=False))
