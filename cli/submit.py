"""`gpuq submit`: queue a built-in workload or the user's own command, through the server.

What only the submitter's own process can know travels with the request: the working directory,
the variables the job inherits (the default set, and those named by --env), and the work tree's
git state, which git reports here, as the user. The server checks all of it and decides whose job
it is from the socket's credentials, not from anything sent."""

from __future__ import annotations

import os
import stat
import sys
import uuid
from typing import Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client, Overdue, Refused
from gpuq.cli.command_line import COMMAND_KEY, DETACH_KEY, NAMED_KEY, RunCommand, SubmitCommand
from gpuq.cli.render import print_json
from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec, Unreachable

app = typer.Typer()

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
RUN_HELP = """Queue a job and follow it here, as srun does: why it waits, then its stdout and stderr as
they come, and its exit code as this command's (124: timed out, 125: ended by gpuq, 130: cancelled by
your Ctrl-C, 1: cancelled otherwise, as by `gpuq cancel` or a failed --after dependency).

Ctrl-C cancels the job (twice: leave at once); a closed terminal cancels it too, and a gpuq run
killed outright ends it within GPUQ_ALLOC_KEEPALIVE (--detach: the job outlives it).
`gpuq run matmul --size 500`, `gpuq run nvidia-smi`, `gpuq run --gpus 2 -- python train.py`."""


@app.command("run", cls=RunCommand, context_settings=_EXTRA, help=RUN_HELP)
@app.command(cls=SubmitCommand, context_settings=_EXTRA)
def submit(
    ctx: typer.Context,
    workload: Annotated[str | None, typer.Argument(help="A built-in workload (see `gpuq workloads`); any other "
                                                        "word is a job script or a program, its words after it "
                                                        "its own, as after --.", show_default=False)] = None,
    gpus: Annotated[numbers.GpuAsk | None, typer.Option(
        "--gpus", "-G", help="GPUs the job needs, all on one node (default: 1, or the least a workload takes); "
        "TYPE:COUNT (a100:2) as sbatch's: COUNT of that --gpu-type.", show_default=False,
        parser=numbers.gpu_count)] = None,
    gres: Annotated[numbers.GpuAsk | None, typer.Option(
        "--gres", help="sbatch's gpu[:TYPE][:COUNT] (gpu:2, gpu:a100:2): the same as --gpus [TYPE:]COUNT.",
        show_default=False, parser=numbers.gres)] = None,
    gpu_type: Annotated[str | None, typer.Option("--gpu-type", help="Only GPUs of this model, as `gpuq devices` "
                                                 "names them: a100, h100, rtx3090.")] = None,
    name: Annotated[str | None, typer.Option("--name", "-J", help="A name to know the job by.")] = None,
    wrap: Annotated[str | None, typer.Option("--wrap", help="Run this shell command line as the job (sh -c), as "
                                             "sbatch --wrap: gpuq submit --wrap 'python a.py && python b.py'.")
                    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job as JSON.")] = False,
    parsable: Annotated[bool, typer.Option("--parsable", help="Print only the job's id (an array's: the array "
                                           "id), as sbatch --parsable: jid=$(gpuq submit --parsable ...).")] = False,
    test_only: Annotated[bool, typer.Option("--test-only", help="Check the job and say when it would start; queue "
                                            "nothing (as sbatch --test-only).")] = False,
    wait: Annotated[bool, typer.Option("--wait", "-W", help="Return once the job (every task) has ended: exit "
                                           "0 only if all succeeded, as gpuq wait (sbatch --wait).")] = False,
    chdir: Annotated[str | None, typer.Option("--chdir", "-D", help="Run in this directory instead of the current "
                                              "one (as sbatch -D); its relative paths (-o, a script) are its.")
                     ] = None,
    priority: Annotated[int, typer.Option(help="Higher goes first (users up to the configured limit).",
                                          parser=numbers.integer)] = 0,
    mem: Annotated[str | None, typer.Option(help="Free GPU memory needed on each GPU, e.g. 20G (with --shared: "
                                                 "the job's share, which it is held to).")] = None,
    shared: Annotated[bool, typer.Option("--shared", help="Share the GPU with other --shared jobs, packed by "
                                                          "--mem (required).")] = False,
    node: Annotated[str | None, typer.Option("--node", "-w", help="Run on this node only.")] = None,
    exclude: Annotated[str | None, typer.Option("--exclude", "-x", help="Never on these nodes (NODE[,NODE]), "
                                                "as sbatch -x.")] = None,
    preemptible: Annotated[bool, typer.Option("--preemptible", help="Run on GPUs no other job waits for, past "
                                              "your GPU limit; requeued (SIGTERM first) when one does.")] = False,
    host_mem: Annotated[str | None, typer.Option(help="Host memory of a command's processes, e.g. 8G: reserved "
                                                      "on its node, and its limit (past it the OOM killer stops "
                                                      "the job).")] = None,
    cpus: Annotated[str | None, typer.Option("--cpus", "-c", help="CPU cores a command's processes may use "
                                             "together, e.g. 4 or 0.5: reserved on its node, and held to "
                                             "(as docker --cpus).")] = None,
    time: Annotated[str | None, typer.Option("--time", "-t", help="Time limit (2h, 30m, or SLURM's 90, 1:30:00, "
                                                               "2-0:00); stopped past it.")] = None,
    retries: Annotated[int, typer.Option(help="Run again up to N times if it fails or its worker is lost.",
                                         parser=numbers.whole(0))] = 0,
    requeue: Annotated[bool | None, typer.Option("--requeue/--no-requeue", help="Run it again (or never) when "
                                                 "the machinery fails under it: its worker or GPU lost, its GPU "
                                                 "failed, its worker shut down (as sbatch's). Default: the "
                                                 "queue's GPUQ_REQUEUE (as set up: only with --retries). A "
                                                 "--preemptible job with --no-requeue ends when preempted.",
                                                 show_default=False)] = None,
    signal: Annotated[str | None, typer.Option("--signal", help="[B:]SIG[@SECONDS]: send SIG this long (default "
                                               "60) before the time limit, to save a checkpoint; B: its main "
                                               "process only (as sbatch --signal).")] = None,
    hold: Annotated[bool, typer.Option("--hold", "-H", help="Queue it held, until `gpuq release`.")] = False,
    mail_type: Annotated[str | None, typer.Option("--mail-type", help="Mail when it begins, ends, fails or is "
                                                  "requeued: BEGIN, END, FAIL, REQUEUE or ALL, comma-separated (as "
                                                  "sbatch --mail-type; an array's mail is about the whole array).")
                         ] = None,
    mail_user: Annotated[str | None, typer.Option("--mail-user", help="Where its mail goes (default: you).")
                         ] = None,
    begin: Annotated[str | None, typer.Option("--begin", "-b", help="Not before then: 16:00, 2026-12-24T09:00, "
                                              "30m or now+2hours (as sbatch --begin).")] = None,
    deadline: Annotated[str | None, typer.Option("--deadline", help="Cancel it if it waits so long that it could not "
                                                 "end by then (its start plus --time), in --begin's forms "
                                                 "(as sbatch --deadline).")] = None,
    after: Annotated[str | None, typer.Option(help="Start after these jobs succeeded (ID[,ID]).")] = None,
    after_any: Annotated[str | None, typer.Option(help="Start after these jobs ended, in any state.")] = None,
    dependency: Annotated[str | None, typer.Option("--dependency", "-d", help="sbatch's form: afterok:ID[:ID] "
                                                   "(as --after), afterany:ID[:ID] (as --after-any), "
                                                   "afternotok:ID (once they failed), after:ID (once they "
                                                   "started); singleton: one job of your own of its name at a "
                                                   "time.")] = None,
    array: Annotated[str | None, typer.Option("--array", "-a", help="An array of tasks: 0-9, 0-9:2 or 1,3,5 "
                                                   "(GPUQ_ARRAY_INDEX; {index} in a command); 0-99%4: "
                                                   "at most 4 of them at once.")] = None,
    sweep: Annotated[list[str] | None, typer.Option(help="name=v1,v2: a job per value (repeat for the "
                                                         "cross product).")] = None,
    snapshot: Annotated[bool, typer.Option("--snapshot", help="Run a copy of this git work tree as it is now "
                                                              "(files .gitignore leaves out are not copied).")] = False,
    env: Annotated[list[str] | None, typer.Option("--env", help="NAME=VALUE, or NAME to pass on its value "
                                                                "here: set for the command (repeatable); ALL: "
                                                                "all of yours it may take.")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Also write the command's output to this "
                                               "file, as you (%j job id, %a array index, %x name; as sbatch "
                                               "-o).")] = None,
    error: Annotated[str | None, typer.Option("--error", "-e", help="Write its stderr to this file instead of "
                                              "--output's.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Submit as this user (root only).")] = None,
    sbatch_line: Annotated[str | None, typer.Option("--sbatch-line", hidden=True, help="sbatch's options, as gpuq's "
                                                    "sbatch (cli/sbatch.py) passes its command line's: a SLURM "
                                                    "script's job, these over its lines.")] = None,
) -> None:
    """Queue a job: `gpuq submit matmul --size 500`, `gpuq submit train.sh`, `gpuq submit -- python train.py`.

    A command runs without a shell, in the directory it was submitted from (or -D's), with
    CUDA_VISIBLE_DEVICES set to the GPUs it was given.
    """
    command = ctx.meta.get(COMMAND_KEY)
    extra = list(ctx.args)
    stray = [a for a in ([workload] if workload is not None else []) + extra if a.startswith("-")]
    if stray and (command is not None or workload is None or workload.startswith("-")):
        # Before `--` only gpuq's own options go (a workload's come after its name): a mistyped one.
        raise InvalidSpec(f"no such option: {stray[0]} (gpuq {ctx.command.name} --help)")
    if wrap is not None:
        if command is not None or workload is not None:
            other = "a workload" if command is None else "a command" + ("" if ctx.meta.get(NAMED_KEY) else " after --")
            raise InvalidSpec(f"give --wrap or {other}, not both")
        if not wrap.strip():
            raise InvalidSpec("--wrap: the command line is empty")
        command = ["sh", "-c", wrap]
    cwd = _cwd() if chdir is None else _directory(chdir)
    script_text = None
    if command is None and workload is None and ctx.command.name == "submit" and not sys.stdin.isatty():
        from gpuq.cli.script import STDIN, from_stdin

        # `gpuq submit < job.sh`, as sbatch reads a script from stdin: the job carries its text.
        read = sys.stdin.buffer.read(c.MAX_ARGV_BYTES + 1)
        if len(read) > c.MAX_ARGV_BYTES:
            raise InvalidSpec(f"the script given on stdin is longer than {c.MAX_ARGV_BYTES // 1024} KiB")
        script_text = read.decode("utf-8", "surrogateescape")
        command = from_stdin(script_text)
        name = name if name is not None else STDIN
    if ctx.meta.get(NAMED_KEY) and command:
        from gpuq.cli.script import command_of

        command = command_of(command, cwd)
    if parsable and (as_json or test_only):
        raise InvalidSpec(f"give --{'json' if as_json else 'test-only'} or --parsable, not both")
    options: dict[str, Any] = {
        "gpus": gpus, "gres": gres, "gpu_type": gpu_type, "name": name, "priority": priority, "mem": mem,
        "shared": shared, "node": node, "exclude": exclude, "preemptible": preemptible,
        "host_mem": host_mem, "cpus": cpus, "time": time, "signal": signal, "retries": retries, "requeue": requeue,
        "hold": hold,
        "begin": begin, "deadline": deadline, "mail_type": mail_type, "mail_user": mail_user,
        "after": after, "after_any": after_any, "dependency": dependency,
        "array": array, "sweep": sweep or [], "snapshot": snapshot, "env": env or [], "output": output,
        "error": error}
    origins: dict[str, str] = {}  # the options a job script gave, and its lines
    if command and wrap is None:
        from gpuq.cli.script import script_options

        # A job script's #GPUQ lines, where the command line left an option out (as sbatch's).
        scripted, origins, slurm = script_options(ctx, command, cwd, script_text, sbatch_line)
        options.update(scripted)
        if slurm is not None:
            from gpuq.cli.sbatch_lines import sbatch_defaults

            sbatch_defaults(options, _cwd(), slurm)  # where it was run, -D or not
    _fold_gres(options, origins)
    options["gpus"], options["gpu_type"] = typed(options["gpus"], options["gpu_type"], origins)
    body: dict[str, Any] = {
        "workload": workload, "args": extra, "command": command, **options, "cwd": cwd, "user": user,
        # The same key on every try: a server that restarted mid-submit makes the jobs once.
        "key": uuid.uuid4().hex,
    }
    array, sweep = body["array"], body["sweep"]
    for moment in ("begin", "deadline"):
        if body[moment] is not None:  # the user's own clock and zone read it: the server gets a moment
            from gpuq.service.units import begin_here

            body[moment] = begin_here(body[moment], f"--{moment}")
    for name in ("output", "error"):
        if body[name]:  # as sbatch: a relative path is the submit directory's (the job's may be a snapshot)
            body[name] = os.path.join(cwd, os.path.expanduser(body[name]))
    body["umask"] = _umask()  # what the job's files are made with: a command's, a workload's checkpoint
    if command is not None:
        body["environ"] = _environ(body["env"])
        # Not for an estimate: nothing of the work tree is recorded.
        body["git"] = None if test_only else _git_state(cwd)
    running = ctx.command.name == "run"
    if running and (array is not None or sweep):
        given = [f" (--{n} from {origins[n]})" for n in ("array", "sweep") if n in origins]
        raise InvalidSpec("gpuq run follows one job; queue an array or a sweep with gpuq submit" + "".join(given))
    if running and (as_json or parsable or wait):
        option = "json" if as_json else "parsable" if parsable else "wait"
        raise InvalidSpec(f"--{option} is for gpuq submit; gpuq run prints the job's own output")
    if test_only and wait:
        raise InvalidSpec("give --test-only or --wait, not both: a test queues nothing to wait for")
    if running and not test_only and not ctx.meta.get(DETACH_KEY, False):
        # The job lives while this process follows it (cli/keep_alive.py); --detach's outlives it.
        body["keep_alive"] = True
        if command is not None:
            from gpuq.cli import input_forward

            body["stdin"] = input_forward.wanted()  # as srun: a pipe or a file, never a terminal
    client = Client()
    try:
        if test_only:
            answer = client.post("/jobs/estimate", body)
            if as_json:
                print_json(answer)
            else:
                typer.echo(answer["line"])
            return
        # A server restarting meanwhile is waited for, as `gpuq wait` waits (the same key on every try:
        # a lab's submit loop goes on through a restart, each job made once).
        made = client.post("/jobs", body, retries=c.SUBMIT_RETRIES, ride_out=True)["jobs"]
    except Refused as refused:
        if not origins or refused.exit_code != c.EXIT_USAGE:
            raise
        from gpuq.cli.script import from_script

        raise Refused(from_script(str(refused), origins), refused.exit_code) from None
    if running:
        from gpuq.cli.follow import follow

        detach = ctx.meta.get(DETACH_KEY, False)
        if body.get("keep_alive"):
            from gpuq.cli import keep_alive

            keep_alive.start(made[0]["id"])
        if body.get("stdin"):
            from gpuq.cli import input_forward

            input_forward.start(made[0]["id"])
        try:
            code = follow(client, made[0]["id"], cancel_on_interrupt=True, detach=detach)
        except Unreachable as gone:
            if not body.get("keep_alive") or isinstance(gone, Overdue):
                raise
            # Nobody says the job is followed from now on: a server back sees its client silent.
            from gpuq.cli.client import ride_out_seconds

            raise Unreachable(f"{gone}; job {made[0]['id']} is kept by this gpuq run, so a server back ends it "
                              f"as client_lost (GPUQ_RIDE_OUT={ride_out_seconds():g}: a longer one waits longer)"
                              ) from None
        raise typer.Exit(code)
    if as_json:
        print_json(made[0] if len(made) == 1 and array is None and not sweep else made)
    elif parsable:
        typer.echo(made[0]["array_id"] if made[0]["array_id"] is not None else made[0]["id"])
    elif len(made) == 1 and made[0]["array_id"] is None:
        typer.echo(f"submitted job {made[0]['id']}")
    else:
        at_once = made[0].get("array_limit")
        typer.echo(f"submitted array {made[0]['array_id']}: jobs {made[0]['id']}-{made[-1]['id']} ({len(made)}"
                   + (f", {at_once} at once at most)" if at_once else ")"))
    if wait:
        _wait_for(client, [j["id"] for j in made], say=not (as_json or parsable))


def _wait_for(client: Client, job_ids: list[int], say: bool) -> None:
    """``--wait``: until the jobs have ended, each one's end state said (``say``); exit 1 unless all
    succeeded."""
    from gpuq.cli.ends import until_ended

    try:
        states = until_ended(client, job_ids, None)
    except KeyboardInterrupt:
        # The jobs are queued, not this process's to stop (as sbatch --wait): said, not cancelled.
        which = f"job {job_ids[0]}" if len(job_ids) == 1 else f"jobs {job_ids[0]}-{job_ids[-1]}"
        typer.echo(f"gpuq: stopped waiting; {which} go{'es' if len(job_ids) == 1 else ''} on (gpuq wait "
                   f"{job_ids[0] if len(job_ids) == 1 else '--array ' + str(job_ids[0])})", err=True)
        raise typer.Exit(c.EXIT_RUN_CANCELLED) from None
    if say:
        for job_id in job_ids:
            typer.echo(f"job {job_id} {states[job_id]}")
    if any(s != c.State.SUCCEEDED for s in states.values()):
        raise typer.Exit(c.EXIT_JOB_FAILED)


def _fold_gres(options: dict[str, Any], origins: dict[str, str]) -> None:
    """``--gres`` given as ``--gpus``: the command line's wins over a script's, as for any option;
    both from one place are refused."""
    gres, scripted = options.pop("gres", None), origins.pop("gres", None)
    if gres is None:
        return
    if options["gpus"] is not None:
        if (scripted is None) == ("gpus" not in origins):  # both on the command line, or both in the script
            raise InvalidSpec("give --gpus or --gres, not both" + (f" ({scripted})" if scripted else ""))
        if scripted is not None:
            return  # the command line's --gpus over the script's --gres
    options["gpus"] = gres
    origins.pop("gpus", None)
    if scripted is not None:
        origins["gpus"] = scripted


def typed(ask: numbers.GpuAsk | None, gpu_type: str | None, origins: dict[str, str] | None = None
          ) -> tuple[int | None, str | None]:
    """The GPU count and type a request sends for ``--gpus`` (COUNT or TYPE:COUNT) and ``--gpu-type``;
    InvalidSpec where the two name different types (``origins``: the script lines that gave them)."""
    if ask is None:
        return None, gpu_type
    if ask.model is not None and gpu_type is not None and ask.model.lower() != gpu_type.strip().lower():
        where = "".join(f" (--{n.replace('_', '-')} from {origins[n]})" for n in ("gpus", "gpu_type")
                        if origins and n in origins)
        raise InvalidSpec(f"--gpus {ask.model}:{ask.count} and --gpu-type {gpu_type} name two GPU types: give "
                          f"one{where}")
    return ask.count, gpu_type if gpu_type is not None else ask.model


def _cwd() -> str:
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise InvalidSpec("the current directory no longer exists") from None


def _directory(path: str) -> str:
    """``--chdir``'s directory, absolute (a relative one is the current directory's)."""
    path = os.path.expanduser(path)
    where = os.path.abspath(path if os.path.isabs(path) else os.path.join(_cwd(), path))
    try:
        mode = os.stat(where).st_mode
    except PermissionError:  # a directory on the way this user may not enter
        raise InvalidSpec(f"--chdir: {where}: permission denied") from None
    except OSError:
        raise InvalidSpec(f"--chdir: {where}: no such directory") from None
    if not stat.S_ISDIR(mode):
        raise InvalidSpec(f"--chdir: {where}: not a directory")
    if not os.access(where, os.X_OK):  # the job runs as this user: it could not start there
        raise InvalidSpec(f"--chdir: {where}: permission denied")
    return where


def _umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _environ(requests: list[str]) -> dict[str, str]:
    """The variables of this process a command job may inherit: the default set and the ones
    --env names without a value; with --env ALL, all but gpuq's own (the server leaves out the
    others a job may not be given). Nothing else of the environment leaves this process."""
    named = {item for item in requests if "=" not in item}
    everything = c.ENV_ALL in named
    return {k: v for k, v in os.environ.items()
            if (everything and not k.startswith("GPUQ_")) or k in c.DEFAULT_ENV
            or k.startswith(c.DEFAULT_ENV_PREFIXES) or k in named}


def _git_state(cwd: str) -> dict[str, Any] | None:
    from gpuq.service.snapshot import capture

    # The server cuts the diff to its own limit (GPUQ_GIT_DIFF_MAX_BYTES); this bounds the request.
    git = capture(cwd, c.MAX_REQUEST_BYTES // 2)
    return None if git is None else git.__dict__
