"""The catalogue of built-in workloads: names, parameters, defaults and limits.

This module is light on purpose (no torch): `gpuq submit` validates a workload's parameters here,
at submit time, so a typo fails in milliseconds and not inside a worker an hour later. The code
that runs a workload lives in ``gpuq.workers.workloads`` and is named by ``Workload.entry``.
"""

from __future__ import annotations

import os
import pwd
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuq.service import reach
from gpuq.service.errors import InvalidSpec
from gpuq.service.rights import Caller

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Param:
    """One parameter of a workload, given on the command line as ``--name value``."""

    name: str
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    # A file or directory: made absolute at submit, as the job's owner means it (``job_path``),
    # since a built-in workload runs inside the worker, not in the submitter's directory.
    path: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, raw: Any, *, cwd: str | None = None, owner: str | None = None) -> Any:
        """The typed value of ``raw``; InvalidSpec saying what to change when it does not fit. A
        path is resolved against the job's working directory ``cwd`` and its ``owner``'s home
        (``job_path``; by default this process's directory and user)."""
        value = self._convert(raw)
        if self.path and value:
            value = job_path(value, cwd=cwd, owner=owner, flag=self.flag)
        if self.choices is not None and value not in self.choices:
            raise InvalidSpec(f"{self.flag} must be one of {', '.join(self.choices)}; got {raw!r}")
        if self.min is not None and value < self.min:
            raise InvalidSpec(f"{self.flag} must be at least {_num(self.min)}; got {raw!r}")
        if self.max is not None and value > self.max:
            raise InvalidSpec(f"{self.flag} must be at most {_num(self.max)}; got {raw!r}")
        return value

    def _convert(self, raw: Any) -> Any:
        if self.type is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise InvalidSpec(f"{self.flag} takes true or false; got {raw!r}")
        if isinstance(raw, bool):
            raise InvalidSpec(f"{self.flag} needs a value")
        try:
            if self.type is int and isinstance(raw, str):
                return int(raw.replace("_", ""), 10)
            if self.type is float:
                value = float(raw)
                if value != value or value in (float("inf"), float("-inf")):
                    raise ValueError(raw)
                return value
            return self.type(raw)
        except (TypeError, ValueError):
            raise InvalidSpec(f"{self.flag} must be {_kind(self.type)}; got {raw!r}") from None


def job_path(value: str, *, cwd: str | None = None, owner: str | None = None, flag: str = "the path") -> str:
    """``value`` made absolute as the job's owner means it, as sbatch resolves a job's paths: a
    relative path in the job's working directory ``cwd``, ``~`` and ``~/x`` in ``owner``'s home,
    ``~alice/x`` in alice's (from the password database, as ``expanduser`` reads it). Never the
    server's own directory or $HOME: on a machine's stack the server is root, started anywhere.
    ``cwd`` defaults to this process's directory and ``owner`` to its user (a client's own)."""
    if value.startswith("~"):
        name, sep, rest = value[1:].partition("/")
        who = name or owner or Caller.of_uid(os.getuid()).user
        try:
            home = pwd.getpwnam(who).pw_dir
        except KeyError:
            what = f"no user {who} here" if name else f"{who} has no home directory here"
            raise InvalidSpec(f"{flag} {value}: {what}") from None
        if not os.path.isabs(home):
            raise InvalidSpec(f"{flag} {value}: {who} has no home directory here")
        value = os.path.join(home, rest) if sep else home
    return os.path.abspath(os.path.join(os.path.abspath(cwd) if cwd else os.getcwd(), value))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _kind(t: type) -> str:
    return {int: "a whole number", float: "a number", str: "text"}.get(t, t.__name__)


@dataclass(frozen=True)
class Workload:
    """A built-in workload: what it is, its parameters, and how many GPUs it can use."""

    name: str
    summary: str
    # "module:function" under gpuq.workers.workloads; imported only by the worker that runs it.
    entry: str
    params: tuple[Param, ...] = ()
    min_gpus: int = 1
    max_gpus: int | None = 1
    # Checks that span several parameters or the GPU count; raise InvalidSpec.
    check: Callable[[dict[str, Any], int], None] | None = field(default=None, compare=False)
    # True for parameters that run one rank in each allocated GPU's own worker (DDP), rather than
    # one process that sees all the job's GPUs; ``rank_entry`` ("module:function") runs one rank.
    rank_per_gpu: Callable[[dict[str, Any]], bool] | None = field(default=None, compare=False)
    rank_entry: str = ""

    def runs_rank_per_gpu(self, params: dict[str, Any], gpus: int) -> bool:
        return gpus > 1 and self.rank_per_gpu is not None and self.rank_per_gpu(params)

    def param(self, name: str) -> Param | None:
        key = name.replace("-", "_")
        return next((p for p in self.params if p.name == key), None)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def validate(self, params: dict[str, Any], gpus: int, *, cwd: str | None = None,
                 owner: str | None = None) -> dict[str, Any]:
        """The full, typed parameter set (defaults filled in) for a job on ``gpus`` GPUs, its paths
        made absolute as the job of ``owner`` in ``cwd`` means them (``job_path``)."""
        unknown = [k for k in params if self.param(k) is None]
        if unknown:
            raise InvalidSpec(self._unknown_message(unknown[0]))
        typed = self.defaults()
        for key, raw in params.items():
            p = self.param(key)
            assert p is not None
            typed[p.name] = p.parse(raw, cwd=cwd, owner=owner)
        self.check_gpus(typed, gpus)
        return typed

    def check_gpus(self, typed: dict[str, Any], gpus: int) -> None:
        """InvalidSpec unless the workload, with its parameters ``typed`` (defaults filled in), runs on
        ``gpus`` GPUs: at submit, and when `gpuq update --gpus` changes a pending job's."""
        if gpus < self.min_gpus:
            raise InvalidSpec(f"{self.name} needs at least {self.min_gpus} GPUs; got --gpus {gpus}")
        if self.max_gpus is not None and gpus > self.max_gpus:
            most = "one GPU" if self.max_gpus == 1 else f"at most {self.max_gpus} GPUs"
            raise InvalidSpec(f"{self.name} runs on {most}; got --gpus {gpus}")
        if self.check is not None:
            self.check(typed, gpus)

    def _unknown_message(self, key: str) -> str:
        flag = "--" + key.replace("_", "-")
        known = ", ".join(p.flag for p in self.params) or "none"
        return f"{self.name} has no parameter {flag} (its parameters: {known})"


def parse_args(workload: Workload, args: Sequence[str]) -> dict[str, Any]:
    """Turn ``["--size", "500", "--cpu-baseline"]`` into ``{"size": "500", "cpu_baseline": True}``.

    Values stay raw here; ``Workload.validate`` types and checks them.
    """
    out: dict[str, Any] = {}
    items = list(args)
    i = 0
    while i < len(items):
        token = items[i]
        if not token.startswith("--") or token == "--":
            # `gpuq submit sleep 60` meant the program of the workload's name, most likely.
            program = shlex.join([workload.name, *items])
            program = program if len(program) <= 80 and program.isprintable() else f"{workload.name} ..."
            raise InvalidSpec(f"unexpected argument {token!r} after workload {workload.name}: "
                              f"parameters are given as --name value (the program {workload.name}: gpuq submit "
                              f"-- {program})")
        key, eq, value = token[2:].partition("=")
        negated = key.startswith("no-") and workload.param(key) is None
        p = workload.param(key[3:] if negated else key)
        if p is None:
            raise InvalidSpec(workload._unknown_message(key))
        if p.name in out:
            raise InvalidSpec(f"{p.flag} is given twice")
        if eq:
            out[p.name] = value
        elif p.type is bool:
            if i + 1 < len(items) and items[i + 1].lower() in _TRUE + _FALSE:
                i += 1
                out[p.name] = items[i]
            else:
                out[p.name] = not negated
        elif i + 1 < len(items):
            i += 1
            out[p.name] = items[i]
        else:
            raise InvalidSpec(f"{p.flag} needs a value")
        i += 1
    return out


# ---- the catalogue ------------------------------------------------------------------------------

_DTYPES = ("fp32", "tf32", "fp16", "bf16")

MATMUL = Workload(
    name="matmul",
    summary="Seed 002 exercise 1: time N products of an SxS matrix on the job's device (TFLOP/s).",
    entry="gpuq.workers.workloads.matmul:run",
    params=(
        Param("size", int, 500, "matrix side S", min=1, max=65536),
        Param("repeat", int, 100, "products timed", min=1, max=1_000_000),
        Param("warmup", int, 3, "untimed products run first", min=0, max=10_000),
        Param("dtype", str, "fp32", "element type", choices=_DTYPES),
        Param("cpu_baseline", bool, False, "also time the same products on the CPU and report the ratio"),
    ),
)

DEVICE_INFO = Workload(
    name="device-info",
    summary="What NVML (nvidia-smi) and torch.cuda say about the job's devices; the CPU when no GPU.",
    entry="gpuq.workers.workloads.device_info:run",
    max_gpus=None,
)

NORM_LOG = Workload(
    name="norm-log",
    summary="Seed 002 exercise 3: N products of SxS matrices logging each Frobenius norm, "
            "copied to the host every step vs kept on the device until the end.",
    entry="gpuq.workers.workloads.norm_log:run",
    params=(
        Param("steps", int, 1000, "products, each logging one norm", min=1, max=10_000_000),
        Param("size", int, 100, "matrix side S", min=1, max=16384),
        Param("warmup", int, 10, "untimed products run first", min=0, max=10_000),
    ),
)

MULTI_MATMUL = Workload(
    name="multi-matmul",
    summary="Seed 002 exercise 4: products on two GPUs at once vs the same products one after "
            "the other on one GPU (the scaling ratio).",
    entry="gpuq.workers.workloads.multi_matmul:run",
    params=(
        Param("size", int, 2048, "matrix side S", min=1, max=32768),
        Param("repeat", int, 20, "products per GPU", min=1, max=100_000),
        Param("warmup", int, 2, "untimed products per GPU run first", min=0, max=1000),
    ),
    min_gpus=2,
    max_gpus=2,
)

COPY = Workload(
    name="copy",
    summary="Copy bandwidth in GB/s: host to device (pinned and pageable), device to host, "
            "device to device; plain memcpy on a CPU-only node.",
    entry="gpuq.workers.workloads.bandwidth:run",
    params=(
        Param("mib", int, 256, "MiB per copy", min=1, max=65536),
        Param("repeat", int, 10, "copies timed per direction", min=1, max=10_000),
        Param("warmup", int, 2, "untimed copies per direction run first", min=0, max=1000),
    ),
    max_gpus=2,
)

_NETS = ("lenet", "resnet18")
_STRATEGIES = ("single", "manual", "dp", "ddp")
# Fashion-MNIST's four IDX files, each accepted plain or gzipped (gpuq.workers.workloads.data).
_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _check_train(params: dict[str, Any], gpus: int) -> None:
    """Strategy against GPU count, batch against GPUs, and the paths, for ``train``.

    ``single`` trains on exactly one GPU; ``manual``, ``dp`` and ``ddp`` split each batch over two
    or more, so every GPU needs at least one example of it.
    """
    strategy = params["strategy"]
    if strategy == "single" and gpus != 1:
        raise InvalidSpec(f"--strategy single trains on one GPU; with --gpus {gpus} "
                          f"choose --strategy manual, dp or ddp")
    if strategy != "single" and gpus < 2:
        raise InvalidSpec(f"--strategy {strategy} splits each batch over several GPUs; "
                          f"give --gpus 2 or more, or use --strategy single")
    if params["batch_size"] < gpus:
        raise InvalidSpec(f"--batch-size {params['batch_size']} is smaller than --gpus {gpus}: "
                          f"every GPU needs at least one example per step")
    if params["lr"] <= 0:
        raise InvalidSpec(f"--lr must be greater than 0; got {params['lr']}")
    data_dir = params["data_dir"]
    # The paths as the job's owner meets them (service/reach.py): the server may be root.
    if data_dir:
        if not reach.is_dir(data_dir):
            raise InvalidSpec(f"--data-dir {data_dir} is not a directory{reach.closed()}")
        missing = [f for f in _IDX_FILES if not any(
            reach.is_file(os.path.join(data_dir, f + gz)) for gz in ("", ".gz"))]
        if missing:
            raise InvalidSpec(f"--data-dir {data_dir} lacks {', '.join(missing)} (plain or .gz); "
                              f"leave --data-dir out to train on synthetic data")
    elif params["train_size"] < gpus:
        raise InvalidSpec(f"--train-size {params['train_size']} is smaller than --gpus {gpus}")
    path = params["checkpoint"]
    if path:
        parent = os.path.dirname(os.path.abspath(path))
        if not reach.is_dir(parent):
            raise InvalidSpec(f"--checkpoint {path}: directory {parent} does not exist{reach.closed()}")
        if reach.is_dir(path):
            raise InvalidSpec(f"--checkpoint {path} is a directory; give a file path")
        if not reach.is_writable_dir(parent):
            # Known now, not after the first epoch's training: its save failed then.
            owner = reach.owner_name()
            by = f" by {owner}" if owner else ""
            raise InvalidSpec(f"--checkpoint {path}: directory {parent} is not writable{by}")


TRAIN = Workload(
    name="train",
    summary="Seed 001: train LeNet or ResNet-18 on Fashion-MNIST (or synthetic data of its shape) "
            "on one GPU or data-parallel on several (manual, dp or ddp).",
    entry="gpuq.workers.workloads.train:run",
    params=(
        Param("model", str, "lenet", "network", choices=_NETS),
        Param("epochs", int, 10, "passes over the training set", min=1, max=100_000),
        Param("batch_size", int, 256, "global minibatch, split over the GPUs", min=1, max=1_000_000),
        Param("lr", float, 0.1, "SGD learning rate (seed 001: scale it with the batch)"),
        Param("strategy", str, "single", "single GPU, or data parallel: manual, dp, ddp",
              choices=_STRATEGIES),
        Param("data_dir", str, "", "directory with Fashion-MNIST's IDX files; none: synthetic data",
              path=True),
        Param("train_size", int, 60000, "synthetic training examples", min=1, max=10_000_000),
        Param("test_size", int, 10000, "synthetic test examples", min=1, max=10_000_000),
        Param("seed", int, 0, "seed of the initial parameters, the shuffles and the synthetic data",
              min=0, max=2**31 - 1),
        Param("checkpoint", str, "", "file saved every epoch, and resumed from when it exists",
              path=True),
    ),
    max_gpus=None,
    check=_check_train,
    rank_per_gpu=lambda params: params["strategy"] == "ddp",
    rank_entry="gpuq.workers.workloads.ranks:run_rank",
)

SLEEP = Workload(
    name="sleep",
    summary="Hold the job's GPUs for --seconds doing nothing (0: a no-op): for testing and measuring the queue.",
    entry="gpuq.workers.workloads.sleep:run",
    params=(Param("seconds", float, 0.0, "how long", min=0, max=30 * 86400),),
    max_gpus=None,
)

CATALOGUE: dict[str, Workload] = {
    w.name: w for w in (MATMUL, DEVICE_INFO, NORM_LOG, MULTI_MATMUL, COPY, TRAIN, SLEEP)
}


def get_workload(name: str) -> Workload:
    """The workload called ``name``; InvalidSpec listing the known ones otherwise."""
    try:
        return CATALOGUE[name]
    except KeyError:
        # `gpuq submit python`: the hint shows their own command after -- (a script's path, with its '.'
        # or '/', is taken as a script by the client: cli/script.py).
        example = shlex.quote(name) if name.strip() and name.isprintable() and len(name) <= 200 else "python train.py"
        raise InvalidSpec(f"unknown workload {name!r}; known: {', '.join(sorted(CATALOGUE))} "
                          f"(a command goes after --: gpuq submit -- {example})") from None
