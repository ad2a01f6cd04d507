"""`gpuq submit`: queue a built-in workload or the user's own command."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from gpuq.cli.render import job_dict, print_json
from gpuq.service import jobs, spec
from gpuq.service.errors import InvalidSpec
from gpuq.service.settings import get_settings

app = typer.Typer()

COMMAND_KEY = "gpuq.command"


class SubmitCommand(TyperCommand):
    """Splits the command line at ``--``: what follows is the user's command, untouched."""

    def parse_args(self, ctx, args):
        if "--" in args:
            cut = args.index("--")
            ctx.meta[COMMAND_KEY] = args[cut + 1:]
            args = args[:cut]
        return super().parse_args(ctx, args)


@app.command(cls=SubmitCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    ctx: typer.Context,
    workload: Annotated[Optional[str], typer.Argument(help="A built-in workload (see `gpuq workloads`).",
                                                      show_default=False)] = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs the job needs, all on one node.")] = 1,
    name: Annotated[Optional[str], typer.Option("--name", help="A name to know the job by.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job as JSON.")] = False,
    priority: Annotated[int, typer.Option(help="Higher goes first (users up to the configured limit).")] = 0,
    mem: Annotated[Optional[str], typer.Option(help="Free GPU memory needed on each GPU, e.g. 20G.")] = None,
    node: Annotated[Optional[str], typer.Option(help="Run on this node only.")] = None,
    host_mem: Annotated[Optional[str], typer.Option(help="Host memory limit of a command's processes, e.g. "
                                                         "8G (past it the OOM killer stops the job).")] = None,
    time: Annotated[Optional[str], typer.Option(help="Time limit (2h, 30m, 1:30:00); stopped past it.")] = None,
    retries: Annotated[int, typer.Option(help="Run again up to N times if it fails or its worker is lost.")] = 0,
    hold: Annotated[bool, typer.Option("--hold", help="Queue it held, until `gpuq release`.")] = False,
    after: Annotated[Optional[str], typer.Option(help="Start after these jobs succeeded (ID[,ID]).")] = None,
    after_any: Annotated[Optional[str], typer.Option(help="Start after these jobs ended, in any state.")] = None,
    array: Annotated[Optional[str], typer.Option(help="An array of tasks: 0-9, 0-9:2 or 1,3,5 "
                                                      "(GPUQ_ARRAY_INDEX; {index} in a command).")] = None,
    sweep: Annotated[Optional[list[str]], typer.Option(help="name=v1,v2: a job per value (repeat for the "
                                                            "cross product).")] = None,
    snapshot: Annotated[bool, typer.Option("--snapshot", help="Run a copy of this git work tree as it is now "
                                                              "(files .gitignore leaves out are not copied).")] = False,
    env: Annotated[Optional[list[str]], typer.Option("--env", help="NAME=VALUE, or NAME to pass on its value "
                                                                   "here: set for the command (repeatable).")] = None,
    user: Annotated[Optional[str], typer.Option("--user", help="Submit as this user (root only).")] = None,
) -> None:
    """Queue a job: `gpuq submit matmul --size 500` or `gpuq submit -- python train.py --lr 0.1`.

    A command runs without a shell, in the directory it was submitted from, with
    CUDA_VISIBLE_DEVICES set to the GPUs it was given.
    """
    command = ctx.meta.get(COMMAND_KEY)
    owner = spec.submitting_user(user)
    if command is not None:
        if workload is not None or ctx.args:
            raise InvalidSpec("give either a workload or a command after --, not both")
        variables = spec.job_env(env or [])

        def make(extra: list[str]) -> spec.JobSpec:
            return spec.command_spec(command, gpus=gpus, name=name, user=owner, env=variables)
    elif snapshot:
        raise InvalidSpec("--snapshot is for a command after --; a built-in workload runs gpuq's own code")
    elif workload is None:
        raise InvalidSpec("nothing to run: name a workload (`gpuq workloads`) or a command after --")
    elif env:
        raise InvalidSpec("--env is for a command (after --); a built-in workload runs in the worker")
    else:

        def make(extra: list[str]) -> spec.JobSpec:
            return spec.workload_spec(workload, list(ctx.args) + extra, gpus=gpus, name=name, user=owner)

    sched = spec.Scheduling(priority=priority, mem=mem, node=node, time=time, retries=retries, hold=hold,
                            after=after, after_any=after_any, host_mem=host_mem)
    specs = spec.expand(make, sched, array, sweep or [])
    submitted = jobs.submit_all(get_settings(), specs, snapshot=snapshot)
    if as_json:
        data = [job_dict(j) for j in submitted]
        print_json(data[0] if len(data) == 1 and array is None and not sweep else data)
    elif len(submitted) == 1 and submitted[0].array_id is None:
        typer.echo(f"submitted job {submitted[0].id}")
    else:
        typer.echo(f"submitted array {submitted[0].array_id}: jobs {submitted[0].id}-{submitted[-1].id} "
                   f"({len(submitted)})")
