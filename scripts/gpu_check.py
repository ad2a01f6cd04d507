"""gpuq on this node's GPUs, end to end: the check to run on a new GPU node (or one lent for half an
hour) before people queue work on it.

    python scripts/gpu_check.py [--out DIR] [--size 8192]

It starts a stack of its own in a temporary home (its own socket, Redis port and SQLite file; a
stack already on the machine is left alone), runs `gpuq` as whole processes the way users do,
and prints a line per check, PASS, FAIL or SKIP, with what it measured:

1. devices: the GPUs as NVML lists them, with a reading of each; and their memory's health
   counters (row remapping, retired pages, uncorrectable ECC errors), with gpuq's drains agreeing;
2. workloads: device-info, matmul in fp32, tf32, fp16 and bf16, norm-log, copy, and LeNet and
   ResNet-18 for an epoch, each a job (on a GPU, none may fall back to the CPU);
3. a command job using torch on its GPU; a `--cpus 1` one on a core of its own, near its GPU
   (each GPU's near cores, as NVML's CPU affinity gives them, are printed);
4. two `--shared --mem` jobs on one GPU at once;
5. a shared job using three times its share, stopped as `gpu_mem_exceeded`; then the same with
   the memory held by a process that left the job's tree and session (`setsid` in a subshell that
   exits), which still counts as the job's and is killed with it;
6. as root, a job of another user (made for the check and removed), run with that user's uid;
7. `gpuq run` and `gpuq alloc`;
8. a job's statistics (samples, energy) and the dashboard's /metrics;
9. `--gpu-type` of this GPU's model runs, and of a model not here is refused;
10. MPS with two users, where NVIDIA's MPS control is installed (last: it starts a daemon of its
    own for the stack, then quits it): root's and another user's `--shared` jobs, submitted a
    second apart (root's first, then the other user's first), both run at once and neither waits
    for the other (one joins MPS, the other runs beside it, its output saying why); then a
    whole-GPU job runs beside the idle MPS server.

The exit status is 1 if any check failed. The figures (results.json), the summary and the
stack's logs are kept in --out. Without an NVIDIA GPU the same checks run on one simulated GPU
with small sizes: tests/test_gpu_check.py runs it so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stack import free_port, has_gpu, stop_on_sigterm

GPUQ = str(Path(sys.executable).with_name("gpuq"))
PY = sys.executable
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"  # found here: a user's PATH lacks /usr/sbin
END = ("succeeded", "failed", "cancelled", "timed_out")


class Check:
    """The stack the checks run against and what they found."""

    def __init__(self, home: Path, env: dict[str, str], real: bool, size: int) -> None:
        self.home, self.env, self.real, self.size = home, env, real, size
        self.results: list[dict[str, Any]] = []
        self.jobs: dict[str, int] = {}

    def gpuq(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
             user: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [GPUQ, *args] if user is None else [RUNUSER, "-u", user, "--", GPUQ, *args]
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=str(self.home.parent))

    def submit(self, *args: str, **kw: Any) -> int:
        done = self.gpuq("submit", *args, **kw)
        found = re.search(r"submitted job (\d+)", done.stdout)
        if done.returncode != 0 or not found:
            raise RuntimeError(f"gpuq submit {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
        return int(found.group(1))

    def show(self, job_id: int) -> dict[str, Any]:
        return json.loads(self.gpuq("show", str(job_id), "--json").stdout)

    def wait(self, ids: list[int], timeout: float) -> list[dict[str, Any]]:
        self.gpuq("wait", *map(str, ids), "--timeout", str(timeout), timeout=timeout + 30)
        return [self.show(i) for i in ids]

    def output(self, job_id: int) -> str:
        return json.loads(self.gpuq("logs", str(job_id), "--json").stdout).get("output", "")

    def run(self, name: str, body: Callable[[Check], tuple[str, str]]) -> None:
        t0 = time.monotonic()
        try:
            verdict, detail = body(self)
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check, and the rest go on
            verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - t0
        self.results.append({"check": name, "verdict": verdict, "detail": detail, "seconds": round(took, 1)})
        print(f"{verdict:4}  {name:10} {detail}  ({took:.1f} s)", flush=True)


def _gpu_command(real: bool, mib: int, seconds: float) -> list[str]:
    """A command holding ``mib`` of GPU memory for ``seconds``: torch on a GPU, declared memory on
    a simulated one (the worker reads it as it reads NVML's process list)."""
    if real:
        return ["--", PY, "-c", f"import torch, time; x = torch.empty({mib} << 20, dtype=torch.uint8, "
                f"device='cuda'); print('holding {mib} MiB', flush=True); time.sleep({seconds})"]
    return ["--", PY, "-m", "gpuq.workers.simulated_memory", "--mib", str(mib), "--seconds", str(seconds)]


def devices(c: Check) -> tuple[str, str]:
    gpus = json.loads(c.gpuq("devices", "--json").stdout)
    if not gpus or any(not g.get("memory_total_mib") for g in gpus):
        return "FAIL", f"no GPU with its memory listed: {gpus}"
    g = gpus[0]
    detail = (f"{len(gpus)} x {g['name']}, {g['memory_total_mib']} MiB; GPU 0 at {g.get('temperature_c')} C, "
              f"{g.get('power_w')} W, {g.get('utilization')}% busy, {g.get('memory_used_mib')} MiB used")
    return "PASS", detail


def workloads(c: Check) -> tuple[str, str]:
    s, small = c.size, c.size <= 1024
    epoch = ["--epochs", "1"] + (["--train-size", "512", "--test-size", "128"] if small else [])
    submits = {"device-info": ["device-info"],
               **{f"matmul-{d}": ["matmul", "--size", str(s), "--repeat", "20", "--dtype", d]
                  for d in ("fp32", "tf32", "fp16", "bf16")},
               "norm-log": ["norm-log"], "copy": ["copy", "--mib", "64" if small else "1024"],
               "lenet": ["train", "--model", "lenet", *epoch],
               "resnet18": ["train", "--model", "resnet18", *epoch]}
    c.jobs |= {name: c.submit(*args, "--name", f"check-{name}") for name, args in submits.items()}
    rows = c.wait(list(c.jobs.values()), timeout=600)
    figures, bad = [], []
    for (name, _), row in zip(c.jobs.items(), rows, strict=True):
        result = row.get("result") or {}
        if row["state"] != "succeeded":
            bad.append(f"{name} {row['state']}: {row.get('reason') or row.get('failure')}")
        elif c.real and result.get("fell_back_to_cpu"):
            bad.append(f"{name} ran on the CPU")
        if "tflops" in result:
            figures.append(f"{name} {result['tflops']:.1f} TFLOP/s")
        elif "examples_per_s" in result:
            figures.append(f"{name} {result['examples_per_s']:.0f} examples/s")
        elif "host_to_device_gbps" in result:
            figures.append(f"copy h2d {result['host_to_device_gbps']:.1f}, d2h {result['device_to_host_gbps']:.1f}, "
                           f"d2d {result['device_to_device_gbps']:.1f} GB/s")
        elif "ratio" in result:
            figures.append(f"norm-log on-device/item {result['ratio']:.2f}")
    return ("FAIL", "; ".join(bad)) if bad else ("PASS", "; ".join(figures))


def command(c: Check) -> tuple[str, str]:
    job = c.submit("--", PY, "-c", "import os, torch; print('GPU', os.environ.get('CUDA_VISIBLE_DEVICES'), "
                   "'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() "
                   "else 'cpu')")
    row, out = c.wait([job], 120)[0], c.output(job).strip()
    if row["state"] != "succeeded" or "GPU " not in out or (c.real and "cuda True" not in out):
        return "FAIL", f"{row['state']}: {out[-300:]}"
    return "PASS", out.splitlines()[-1]


def cores(c: Check) -> tuple[str, str]:
    """A `--cpus 1` command runs on one core of its own, near its GPU where NVML says which cores
    are (``nvmlDeviceGetCpuAffinity``; workers/core_binding.py); the GPUs' near cores are printed."""
    from gpuq.service.core_sets import format_list
    from gpuq.service.devices import NvmlDevices

    near = {g.index: g.cores for g in NvmlDevices().list()} if c.real else {}
    job = c.submit("--cpus", "1", "--", PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)), "
                   "os.environ.get('GPUQ_CORES'), os.environ.get('CUDA_VISIBLE_DEVICES'))")
    row, out = c.wait([job], 120)[0], c.output(job).strip()
    said = "; ".join(f"GPU {i} near cores {format_list(n) or 'not known'}" for i, n in sorted(near.items())) \
        or "no NVML: no near cores known"
    found = re.search(r"^\[(\d+)\] (\d+) (\d+)$", out, re.MULTILINE)
    if row["state"] != "succeeded" or found is None or found[1] != found[2]:
        return "FAIL", f"{row['state']}: {out[-300:]}; {said}"
    core, gpu = int(found[1]), int(found[3])
    close = near.get(gpu)
    ok = not close or core in close
    return ("PASS" if ok else "FAIL"), f"--cpus 1 on core {core} (GPUQ_CORES {found[2]}) of GPU {gpu}; {said}"


def shared(c: Check) -> tuple[str, str]:
    ids = [c.submit("--shared", "--mem", "1G", *_gpu_command(c.real, 512, 6)) for _ in range(2)]
    rows = c.wait(ids, 180)
    if any(r["state"] != "succeeded" for r in rows):
        return "FAIL", "; ".join(f"{r['id']} {r['state']}: {r.get('reason')}" for r in rows)
    a, b = rows
    overlap = min(a["ended_at"], b["ended_at"]) > max(a["started_at"], b["started_at"])
    verdict = "PASS" if overlap else "FAIL"
    return verdict, f"jobs {a['id']} and {b['id']} {'ran' if overlap else 'did not run'} at once"


def watchdog(c: Check) -> tuple[str, str]:
    job = c.submit("--shared", "--mem", "1G", *_gpu_command(c.real, 3072, 60))
    row = c.wait([job], 120)[0]
    ok = row["state"] == "failed" and row.get("failure") == "gpu_mem_exceeded"
    return ("PASS" if ok else "FAIL"), f"{row['state']} ({row.get('failure')}): {row.get('reason')}"


def detached(c: Check) -> tuple[str, str]:
    # The subshell exits at once, so the holder is reparented away from the job's tree, and setsid
    # takes it out of the job's session and process group: the watch must still count it (its
    # GPUQ_RUN_ID, its cgroup) and the stop must reach it.
    hold = shlex.join(_gpu_command(c.real, 3072, 60)[1:])
    job = c.submit("--shared", "--mem", "1G", "--", "sh", "-c", f'(setsid {hold} & echo "holder $!"); sleep 60')
    row = c.wait([job], 120)[0]
    found = re.search(r"holder (\d+)", c.output(job))
    if not found:
        return "FAIL", f"{row['state']}: the job printed no holder pid"
    holder, deadline = int(found.group(1)), time.monotonic() + 10
    while psutil.pid_exists(holder) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = psutil.pid_exists(holder)
    ok = row["state"] == "failed" and row.get("failure") == "gpu_mem_exceeded" and not alive
    return ("PASS" if ok else "FAIL"), (f"{row['state']} ({row.get('failure')}): {row.get('reason')}; "
                                        f"holder {holder} {'still alive' if alive else 'gone'}")


class NoUser(Exception):
    """Another user cannot be made or cannot reach gpuq here: the checks needing one are skipped."""


@contextlib.contextmanager
def another_user(c: Check) -> Iterator[tuple[str, dict[str, str]]]:
    """A user made for a check (and removed after it) and the environment their `gpuq` runs with."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(RUNUSER):
        raise NoUser("needs root, useradd and runuser")
    name = f"gpuqchk{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], capture_output=True, text=True)
    if made.returncode != 0:
        raise NoUser(f"useradd: {made.stderr.strip()}")
    try:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": f"/home/{name}", "GPUQ_SOCKET": c.env["GPUQ_SOCKET"]}
        if c.gpuq("--help", env=env, user=name).returncode != 0:
            raise NoUser(f"{GPUQ} is not reachable by other users here (install gpuq where they can run it)")
        yield name, env
    finally:
        subprocess.run(["userdel", "-r", "-f", name], capture_output=True)


def other_user(c: Check) -> tuple[str, str]:
    try:
        with another_user(c) as (name, env):
            job = c.submit("--", PY, "-c", "import os, torch; print(os.getuid(), torch.cuda.is_available())",
                           env=env, user=name)
            row, out = c.wait([job], 120)[0], c.output(job).strip()
            uid = pwd.getpwnam(name).pw_uid
            ok = row["state"] == "succeeded" and row.get("user") == name and out.startswith(str(uid))
            detail = f"job {job} of {name}: {row['state']}, printed {out[-200:]!r} (uid {uid})"
            return ("PASS" if ok else "FAIL"), detail
    except NoUser as why:
        return "SKIP", str(why)


def interactive(c: Check) -> tuple[str, str]:
    ran = c.gpuq("run", "--", PY, "-c", "print('ran here')")
    held = c.gpuq("alloc", "--", "sh", "-c", 'echo "held GPU $CUDA_VISIBLE_DEVICES"')
    ok = ran.returncode == 0 and "ran here" in ran.stdout and held.returncode == 0 and "held GPU " in held.stdout
    detail = (f"run: {ran.returncode} {ran.stdout.strip()[-60:]!r}; "
              f"alloc: {held.returncode} {held.stdout.strip()[-60:]!r}")
    return ("PASS" if ok else "FAIL"), detail


def stats_and_metrics(c: Check) -> tuple[str, str]:
    job = c.jobs.get("resnet18")
    if job is None:
        return "SKIP", "no workload job to read"
    summary = json.loads(c.gpuq("stats", str(job), "--json").stdout)
    port = free_port()
    dash = subprocess.Popen([GPUQ, "dashboard", "--port", str(port)], env=c.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        text, deadline = "", time.monotonic() + 30
        while time.monotonic() < deadline and "gpuq_gpu_up" not in text:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.3)
    finally:
        dash.terminate()
        dash.wait(10)
    gauges = sorted({ln.split("{")[0] for ln in text.splitlines() if ln.startswith("gpuq_gpu")})
    ok = "gpuq_gpu_up" in text and summary.get("wall_s", 0) > 0
    energy, util = summary.get("energy_j"), summary.get("utilization_mean")
    detail = (f"job {job}: {summary.get('samples')} samples, energy {'n/a' if energy is None else f'{energy:.0f}'} J, "
              f"peak {summary.get('memory_peak_mib')} MiB, "
              f"mean utilisation {'n/a' if util is None else f'{util:.0f}'}%; "
              f"/metrics: {', '.join(gauges) or 'nothing'}")
    return ("PASS" if ok else "FAIL"), detail


def gpu_type(c: Check) -> tuple[str, str]:
    name = json.loads(c.gpuq("devices", "--json").stdout)[0]["name"]
    # The model's own word: "NVIDIA H100 80GB HBM3" is an h100, "NVIDIA GeForce RTX 3090" an rtx.
    model = next(w for w in name.lower().split() if w not in ("nvidia", "geforce", "tesla", "quadro"))
    job = c.submit("--gpu-type", model, "--", "true")
    row = c.wait([job], 120)[0]
    wrong = c.gpuq("submit", "--gpu-type", "zz9", "--", "true")
    ok = row["state"] == "succeeded" and wrong.returncode == 2 and "no GPU is one" in wrong.stderr
    return ("PASS" if ok else "FAIL"), (f"--gpu-type {model} on {name!r}: {row['state']}; --gpu-type zz9: exit "
                                        f"{wrong.returncode}, {wrong.stderr.strip()[:160]!r}")


def health(c: Check) -> tuple[str, str]:
    """NVML's memory health counters of each GPU, as the heartbeat judges them (an unhealthy GPU is
    drained), and whether NVML gives its Xid events (service/xids.py); PASS where gpuq's drains
    agree with them. The suite drains a simulated GPU marked unhealthy; a real one shows here
    whether this machine's driver keeps the counters and gives the events."""
    if not c.real:
        return "SKIP", "no NVML here (tests/test_faults.py drains a simulated GPU marked unhealthy)"
    import pynvml

    from gpuq.service.devices import NvmlDevices, _na
    from gpuq.service.inventory import UNHEALTHY
    from gpuq.service.xids import XidWatch

    devices = NvmlDevices()
    said, unhealthy = [], set()
    for g in devices.list():
        h = devices._handle(g.index)
        verdict = devices.health(h) or devices.xid_fault(g.index, h)
        events = "Xid events watched" if XidWatch.open(pynvml, h) is not None else "no Xid events from NVML"
        if verdict:
            unhealthy.add(g.index)
        calls = {"remapped rows (corr, uncorr, pending, failed)": (pynvml.nvmlDeviceGetRemappedRows,),
                 "retired pages pending": (pynvml.nvmlDeviceGetRetiredPagesPendingStatus,),
                 "volatile uncorrectable ECC": (pynvml.nvmlDeviceGetTotalEccErrors,
                                                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
                 "ECC mode (current, pending)": (pynvml.nvmlDeviceGetEccMode,)}
        counters = {k: _na(lambda call=call, h=h: call[0](h, *call[1:]), pynvml) for k, call in calls.items()}
        said.append(f"GPU {g.index}: {verdict or 'healthy'} ({'; '.join(f'{k} {v}' for k, v in counters.items())}; "
                    f"{events})")
    time.sleep(2)  # a heartbeat or two
    drained = {g["index"] for g in json.loads(c.gpuq("devices", "--json").stdout)
               if (g.get("drain_reason") or "").startswith(UNHEALTHY)}
    return ("PASS" if drained == unhealthy else "FAIL"), "; ".join(said) + f"; drained as unhealthy: {sorted(drained)}"


def mps(c: Check) -> tuple[str, str]:
    control = shutil.which("nvidia-cuda-mps-control")
    if not c.real or control is None:
        return "SKIP", "no NVIDIA MPS control here"
    pipes = c.env["CUDA_MPS_PIPE_DIRECTORY"]
    daemon_env = {**c.env, "CUDA_MPS_LOG_DIRECTORY": str(Path(pipes).parent / "mps-log")}
    for folder in (pipes, daemon_env["CUDA_MPS_LOG_DIRECTORY"]):
        Path(folder).mkdir(mode=0o755, exist_ok=True)  # the other user's job reaches the daemon here
    started = subprocess.run([control, "-d"], env=daemon_env, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        return "FAIL", f"nvidia-cuda-mps-control -d: {started.stderr.strip()}"
    pairs: list[list[dict[str, Any]]] = []
    outputs: dict[int, str] = {}
    try:
        with another_user(c) as (name, env):
            # Each job imports torch (seconds), takes 512 MiB of its GPU and holds it for 8 s: the
            # second, a second later, asks for CUDA while the first may not have yet (stop 39).
            # Root's first, then the other user's first.
            hold = _gpu_command(True, 512, 8)
            for users in ((None, name), (name, None)):
                ids = []
                for user in users:
                    as_user: dict[str, Any] = {"env": env, "user": user} if user else {}
                    ids.append(c.submit("--shared", "--mem", "2G", *hold, **as_user))
                    time.sleep(1)
                pairs.append(c.wait(ids, 180))
                outputs |= {i: c.output(i) for i in ids}
            whole = c.submit("--", PY, "-c", "import torch; torch.ones(1, device='cuda'); print('whole GPU')")
            whole_row = c.wait([whole], 120)[0]
    except NoUser as why:
        return "SKIP", str(why)
    finally:
        subprocess.run([control], input="quit\n", env=daemon_env, capture_output=True, text=True, timeout=30)
    said, ok = [], whole_row["state"] == "succeeded"
    for a, b in pairs:
        ran = [f"job {r['id']} ({r['user']}) {r['state']} in {_between(r, 'started_at', 'ended_at'):.1f} s, "
               f"{'outside MPS' if 'runs outside MPS' in outputs[r['id']] else 'in MPS'}" for r in (a, b)]
        overlap = min(a["ended_at"] or "", b["ended_at"] or "") > max(a["started_at"] or "~", b["started_at"] or "~")
        said.append(", ".join(ran) + f": {'at once' if overlap else 'one after the other'}")
        # Each holds for 8 s after torch's import and its CUDA context: 30 s is far past that, and
        # far short of one waiting for the other to end (stop 39: 51 s).
        ok = ok and overlap and all(r["state"] == "succeeded" and _between(r, "started_at", "ended_at") < 30
                                    for r in (a, b))
    waited = _between(whole_row, "submitted_at", "started_at") if whole_row.get("started_at") else None
    return ("PASS" if ok else "FAIL"), ("; ".join(said) + f"; a whole-GPU job beside the MPS server: "
                                        f"{whole_row['state']}"
                                        + (f", {waited:.1f} s from submit to start" if waited is not None else ""))


def _between(row: dict[str, Any], first: str, then: str) -> float:
    """Seconds from a job's ``first`` time to its ``then`` (ISO times, as `gpuq show --json` gives)."""
    if not row.get(first) or not row.get(then):
        return float("inf")
    return (datetime.fromisoformat(row[then]) - datetime.fromisoformat(row[first])).total_seconds()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"), help="where the figures and logs are kept")
    ap.add_argument("--size", type=int, help="matrix side of the matmul jobs (default 8192 on a GPU, 256 simulated)")
    args = ap.parse_args()
    stop_on_sigterm()  # a `timeout` still takes the stack down
    real = has_gpu()
    base = Path(tempfile.mkdtemp(prefix="gpuq-check-", dir="/tmp"))
    os.chmod(base, 0o711)  # other users traverse to the stack's socket; they never list it
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    env |= {"GPUQ_HOME": str(base / "home"), "GPUQ_SOCKET": str(base / "gpuq.sock"),
            "GPUQ_REDIS_PORT": str(free_port()), "GPUQ_CONFIG": str(base / "none.toml"),
            "GPUQ_SAMPLE_INTERVAL": "0.5", "GPUQ_SHARED_MEM_GRACE": "2",
            # The MPS check's own daemon listens here; none does before it, so the other checks run
            # without MPS whatever daemon the machine has at the default place.
            "CUDA_MPS_PIPE_DIRECTORY": str(base / "mps")}
    if not real:
        env |= {"GPUQ_FAKE_GPUS": "1", "GPUQ_WARM_START": "false"}
    check = Check(base / "home", env, real, args.size or (8192 if real else 256))
    print(f"gpu check: {'NVIDIA GPUs (NVML)' if real else 'no NVIDIA GPU here: one simulated GPU'}; stack in {base}",
          flush=True)
    try:
        t0 = time.monotonic()
        up = check.gpuq("up", "--timeout", "300", timeout=330)
        print(f"{'PASS' if up.returncode == 0 else 'FAIL':4}  {'up':10} {(up.stdout or up.stderr).strip()[:200]} "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
        check.results.append({"check": "up", "verdict": "PASS" if up.returncode == 0 else "FAIL",
                              "detail": (up.stdout or up.stderr).strip(), "seconds": round(time.monotonic() - t0, 1)})
        if up.returncode == 0:
            for name, body in (("devices", devices), ("health", health), ("workloads", workloads), ("command", command),
                               ("cores", cores), ("shared", shared), ("watchdog", watchdog), ("detached", detached),
                               ("other-user", other_user),
                               ("run-alloc", interactive), ("stats", stats_and_metrics),
                               ("gpu-type", gpu_type), ("mps", mps)):
                check.run(name, body)
    finally:
        check.gpuq("down", "--grace", "5", timeout=120)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(check.results, indent=1) + "\n")
        shutil.copytree(base / "home" / "logs", args.out / "logs", dirs_exist_ok=True)
        shutil.rmtree(base, ignore_errors=True)
    failed = [r["check"] for r in check.results if r["verdict"] == "FAIL"]
    print(f"{len(check.results) - len(failed)} of {len(check.results)} checks passed or skipped"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; figures and logs in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
