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
) -> None:
    """Queue a job: `gpuq submit matmul --size 500` or `gpuq submit -- python train.py --lr 0.1`.

    A command runs without a shell, in the directory it was submitted from, with
    CUDA_VISIBLE_DEVICES set to the GPUs it was given.
    """
    command = ctx.meta.get(COMMAND_KEY)
    if command is not None:
        if workload is not None or ctx.args:
            raise InvalidSpec("give either a workload or a command after --, not both")
        job_spec = spec.command_spec(command, gpus=gpus, name=name)
    elif workload is None:
        raise InvalidSpec("nothing to run: name a workload (`gpuq workloads`) or a command after --")
    else:
        job_spec = spec.workload_spec(workload, list(ctx.args), gpus=gpus, name=name)
    job = jobs.submit(get_settings(), job_spec)
    if as_json:
        print_json(job_dict(job))
    else:
        typer.echo(f"submitted job {job.id}")
