"""`gpuq sbatch`, and the `sbatch` inside a gpuq job from a SLURM script or in a `gpuq alloc` shell: a
job submitted as sbatch submits one, from its whole command line, through `gpuq submit`: so that a
lab's sbatch lines work as they are (`alias sbatch='gpuq sbatch'`), and a script that queues its
next part (``sbatch --dependency=afterok:$SLURM_JOB_ID next.sbatch``) runs as it did under SLURM.

In a job it is on the PATH beside gpuq's srun (service/slurm_bin.py). Its options are read as the
script's ``#SBATCH`` lines are (cli/sbatch_lines.py), over them, as sbatch's command line goes over
its script's lines; ``--parsable``, ``--wait``, ``--test-only`` and ``-D`` are gpuq submit's own;
``--wrap`` is a script of that command line, as sbatch makes one; with no script named, the script
is read from stdin. The job is a SLURM script's whatever its lines (its srun, SLURM's variables,
its output in slurm-%j.out). It says what sbatch says, "Submitted batch job N" (the id alone with
``--parsable``), and ends with gpuq's status.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import typer

app = typer.Typer()

# The script sbatch makes of --wrap's command line.
_WRAPPED = "#!/bin/sh\n# This script was created by sbatch --wrap.\n\n{}\n"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def sbatch(ctx: typer.Context) -> None:
    """Queue a job as sbatch does, from its command line: `gpuq sbatch -J train --mem 16G -c 4 train.sbatch`.

    sbatch's options are read as the script's #SBATCH lines are, over them (`alias sbatch='gpuq
    sbatch'`); it says "Submitted batch job N". `gpuq submit --help` for gpuq's own options.
    """
    raise typer.Exit(main(ctx.args))


_USAGE = ("usage: gpuq sbatch [sbatch's options] [script [its arguments]] | --wrap 'command line'\n"
          "  options as an #SBATCH line takes them (-J, -t, -c, --mem, --gres, -a, -d, -o, --ntasks-per-node, ...),\n"
          "  and --parsable, --wait, --test-only, -D DIR; no script: read from stdin. gpuq submit --help for gpuq's.")


def main(argv: list[str]) -> int:
    from gpuq.cli.sbatch_lines import command_line
    from gpuq.service.errors import InvalidSpec

    if argv[:1] in (["--help"], ["-h"], ["--usage"]) or not argv and sys.stdin.isatty():
        print(_USAGE)
        return 0 if argv else 2
    try:
        read = command_line(argv)
        if read.wrap is not None and read.script:
            raise InvalidSpec("give --wrap or a script, not both")
        if read.script and not os.path.isfile(read.script[0]):
            raise InvalidSpec(f"{read.script[0][:200]}: no such file (sbatch takes a script; gpuq submit takes a "
                              "command too)")
    except InvalidSpec as refused:
        print(f"gpuq sbatch: {refused}", file=sys.stderr)
        return 2
    if read.script and os.sep not in read.script[0]:  # a file here, whatever workload shares its name
        read.script[0] = os.path.join(os.curdir, read.script[0])
    parsable = "--parsable" in read.submit
    said_by_gpuq = parsable or "--wait" in read.submit or "--test-only" in read.submit
    argv = [sys.executable, "-m", "gpuq.cli", "submit", *read.submit, *([] if said_by_gpuq else ["--parsable"]),
            "--sbatch-line", shlex.join(read.options), *read.script]  # the script named, as sbatch takes one
    text = None if read.wrap is None else _WRAPPED.format(read.wrap)
    done = subprocess.run(argv, input=text, text=True, stdout=None if said_by_gpuq else subprocess.PIPE)
    if done.returncode == 0 and not said_by_gpuq:
        print(f"Submitted batch job {done.stdout.strip()}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
