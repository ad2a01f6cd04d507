"""Constants in one place, each with the reason it has the value it has."""

import signal
from enum import StrEnum


class State(StrEnum):
    """A job's states: the value of ``jobs.state``. Truth lives in SQL; which state may go to which,
    and who makes each move, is the table in service/lifecycle.py."""

    PENDING = "pending"  # queued, waiting for GPUs
    DISPATCHED = "dispatched"  # GPUs allocated, message sent to the first GPU's worker
    RUNNING = "running"  # a worker claimed it and runs it
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


ACTIVE_STATES = (State.PENDING, State.DISPATCHED, State.RUNNING)
END_STATES = (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.TIMED_OUT)
ALL_STATES = ACTIVE_STATES + END_STATES
# Not a state: what a cancel answers, and `gpuq status` shows, for a running job whose worker was
# asked to stop it and has not yet (its row is still running, with cancel_requested_at set).
CANCELLING = "cancelling"
# The same for a running job asked to go back to the queue (`gpuq requeue`), which its reason says:
# who asked, and whether it will wait held.
REQUEUEING = "requeueing"
REQUEUED_BY, REQUEUED_HELD_BY = "requeued by ", "requeued and held by "
# An admin's requeuehold of another user's job: held as an admin's hold, which only an admin releases
# ("requeued and held by an admin (root)"; it reads as a REQUEUED_HELD_BY too).
REQUEUED_ADMIN_HELD = REQUEUED_HELD_BY + "an admin"
# And a preemptible job stopped for a waiting job's GPUs (`--preemptible`): it is requeued the same
# way, its reason "preempted by job 12 of alice", and is being preempted until it stopped (the job
# it makes room for waits for "preempting", policy.PREEMPTING).
BEING_PREEMPTED = "being preempted"
PREEMPTED_BY = "preempted by "

# The built-in workloads' names (service/workloads.py's CATALOGUE, held to them by a test): the client
# tells a workload's name from a script or a program named in its place (cli/script.py) by them,
# without importing the catalogue (12 ms a `gpuq submit`).
WORKLOAD_NAMES = frozenset({"copy", "device-info", "matmul", "multi-matmul", "norm-log", "sleep", "train"})

# Why a job failed or stopped, in one word: shown by `gpuq show` and kept on every attempt.
FAILURE_EXIT = "exit"  # a command exited non-zero
FAILURE_ERROR = "error"  # a built-in workload raised
FAILURE_CUDA_OOM = "cuda_oom"  # CUDA out of memory (the exception, or its message in the output)
FAILURE_HOST_OOM = "host_oom"  # killed by the kernel's OOM killer (the job's memory cgroup says so)
FAILURE_TIMEOUT = "timeout"  # its --time ran out
FAILURE_CANCELLED = "cancelled"  # someone cancelled it
FAILURE_WORKER_LOST = "worker_lost"  # its lease ran out: the worker died or lost the database
FAILURE_INTERRUPTED = "interrupted"  # its worker was shut down before it ended
FAILURE_GPU_LOST = "gpu_lost"  # NVML said the GPU fell off the bus or needs a reset
FAILURE_CLIENT_LOST = "client_lost"  # a kept job's `gpuq alloc` or `gpuq run` stopped answering (killed, ssh dropped)
FAILURE_GPU_MEM_EXCEEDED = "gpu_mem_exceeded"  # a shared job used more GPU memory than its share, past the grace
# Its GPU failed under it: the command died as its GPU went unhealthy or lost (NVML, workers/gpu_fault.py),
# or it printed CUDA's own words for a hardware error (uncorrectable ECC or NVLink error).
FAILURE_GPU_ERROR = "gpu_error"
# A preemptible job stopped for a waiting job that was not to be requeued (`--no-requeue`, or
# GPUQ_REQUEUE=no): it ends there, cancelled, as SLURM's PreemptMode=REQUEUE cancels a job it may not requeue.
FAILURE_PREEMPTED = "preempted"
FAILURES = (FAILURE_EXIT, FAILURE_ERROR, FAILURE_CUDA_OOM, FAILURE_HOST_OOM, FAILURE_TIMEOUT, FAILURE_CANCELLED,
            FAILURE_WORKER_LOST, FAILURE_INTERRUPTED, FAILURE_GPU_LOST, FAILURE_CLIENT_LOST, FAILURE_GPU_MEM_EXCEEDED,
            FAILURE_GPU_ERROR, FAILURE_PREEMPTED)
# Failures of the machinery, not the job: a job that asked for retries is put back without using
# one up (up to the max_requeues setting).
INFRA_FAILURES = (FAILURE_WORKER_LOST, FAILURE_INTERRUPTED, FAILURE_GPU_LOST, FAILURE_GPU_ERROR)

# Job kinds.
KIND_WORKLOAD = "workload"  # a built-in torch workload run inside the warm worker
KIND_COMMAND = "command"  # the user's own argv, run as a child process
# GPUs held for a shell or a command that `gpuq alloc` runs in the user's own terminal; the worker
# hosts the allocation (lease, time limit, cancel, samples) and stops what it started at its end.
KIND_INTERACTIVE = "interactive"

# The Celery tasks gpuq sends. run_job's only argument is the job id (the rest comes from SQL);
# run_rank asks the worker of one of a job's other GPUs to run its rank (job id, rank).
RUN_JOB_TASK = "gpuq.run_job"
RUN_RANK_TASK = "gpuq.run_rank"

# Exit codes of the CLI, named so scripts can tell failures apart (sysexits.h where one fits).
EXIT_OK = 0
EXIT_JOB_FAILED = 1  # `gpuq wait`: the job ended in a state other than succeeded
EXIT_USAGE = 2  # bad input: the command line or a job spec
EXIT_NOT_FOUND = 3  # no such job
EXIT_CONFLICT = 4  # the job is not in a state that allows this
EXIT_TIMEOUT = 5  # `gpuq wait --timeout` ran out first
EXIT_NOT_ALLOWED = 77  # another user's job
EXIT_OVER_LIMIT = 75  # a per-user limit (pending jobs) refuses it for now: try again later
EXIT_UNAVAILABLE = 69  # the database or the broker cannot be reached
EXIT_SOFTWARE = 70  # a bug in gpuq: please report it
EXIT_CONFIG = 78  # the settings are wrong
# `gpuq run`, `gpuq attach` and `gpuq alloc` exit with the job's own code: 0, a command's exit code,
# 128+N for a command killed by signal N, 1 for a built-in workload that raised. An end that gpuq
# made has a code of its own (docker run's 125 for "not the command's doing"; timeout(1)'s 124).
EXIT_RUN_TIMED_OUT = 124  # its --time ran out
EXIT_RUN_GPUQ = 125  # gpuq ended it: worker lost or shut down, GPU lost or failed, client lost, over its share
# Cancelled by `gpuq run`'s own Ctrl-C, as a shell reports it (otherwise: EXIT_JOB_FAILED); a wait
# (`gpuq wait`, `submit -W`) that Ctrl-C stopped, the jobs left as they are, exits with it too.
EXIT_RUN_CANCELLED = 130

# Largest job name we store; SQL column size.
MAX_NAME_LENGTH = 200
# Largest command line we store, in bytes once JSON-encoded: a command is not a data channel.
MAX_ARGV_BYTES = 128 * 1024
# Output is kept in SQL in chunks of at most this many bytes, flushed at least this often.
OUTPUT_CHUNK_BYTES = 64 * 1024
OUTPUT_FLUSH_SECONDS = 0.5
# Which stream a chunk of output came from (job_output.stream): a command's stdout and stderr are
# kept apart, so `gpuq run` gives each back to its own file; a built-in workload writes stdout.
STDOUT = 0
STDERR = 1
# A client following a job (`gpuq run`, `gpuq logs -f`) asks the server to answer once there is
# news, waiting at most this long per request; the server looks at SQL this often meanwhile.
FOLLOW_WAIT_SECONDS = 10.0
FOLLOW_LOOK_SECONDS = 0.05
# A shared built-in workload's share of its GPU's memory (0-1), given to the child that runs it.
MEMORY_FRACTION_VARIABLE = "GPUQ_MEMORY_FRACTION"
# `gpuq alloc` warns on the terminal this long before the allocation's --time runs out (half
# the time limit when that is shorter than twice this).
ALLOC_WARN_SECONDS = 300.0
# Seconds a stopped job's processes get to disappear after SIGKILL before the GPU is drained
# instead of freed (a process in uninterruptible sleep can outlive SIGKILL for a while).
STOP_VERIFY_SECONDS = 30.0
# Characters of a job's output the worker keeps in mind to tell why it failed.
OUTPUT_TAIL_CHARS = 64 * 1024
# Lines of a failed job's last output `gpuq show` prints under its failure.
FAILURE_TAIL_LINES = 10
# A worker stops its job itself once it could not renew the lease for this share of the lease
# time, so the job is gone before the reaper can hand the GPU to a second copy.
LEASE_SELF_FENCE = 0.8
# How often a running job's worker looks at SQL for a cancel request.
CANCEL_POLL_SECONDS = 0.2
# A worker's watch thread (workers/watch.Watch) ends after this many seconds without a job.
WATCH_IDLE_SECONDS = 10.0
# How often `gpuq wait` and `gpuq logs -f` look at SQL.
CLIENT_POLL_SECONDS = 0.2
# Timeout for reaching Redis from the CLI: an unreachable broker must fail fast, not hang.
BROKER_CONNECT_TIMEOUT = 3.0
# A process that heard from the broker this recently takes it as reachable without a ping: a
# submit to a broker that went down since is written, and its message sent once it is back.
BROKER_TRUSTED_SECONDS = 1.0

# Device samples are written this many at a time (and when a job ends): never a transaction each.
SAMPLE_BATCH = 5
# A job's end takes a last reading of its GPU unless the GPU was read less than this long ago
# (seconds; at most a tenth of the sampling interval): under a flood of short jobs a GPU is read at
# most ten times a second, not once a job.
END_READING_GAP = 0.1
# A GPU below this utilisation (percent) counts as idle, in job summaries and the idle flag.
IDLE_UTILIZATION = 10
# `gpuq status` flags a running job whose GPUs were idle for at least this share of the idle window.
IDLE_SHARE = 0.9
# How often each worker rolls its own GPU's samples past retention into minute aggregates, seconds.
ROLLUP_EVERY = 3600.0
# How often the scheduler removes snapshots past GPUQ_SNAPSHOT_RETENTION_DAYS, seconds (and at start).
SNAPSHOT_PRUNE_EVERY = 3600.0
# How often, at most, the scheduler looks for jobs idle past GPUQ_IDLE_LIMIT, seconds (a tenth of the
# limit where that is less): a look sums the running jobs' samples over the whole limit.
IDLE_LIMIT_CHECK_EVERY = 60.0
# How often the scheduler's mail thread looks for jobs to mail about (`--mail-type`), seconds.
MAIL_EVERY = 2.0
# Width of an aggregate row, seconds: raw samples past retention become one row per GPU, job and minute.
AGGREGATE_SECONDS = 60
# Raw samples are rolled up a day at a time, each day in its own transaction.
ROLLUP_CHUNK_SECONDS = 86400
# Refresh period of `gpuq devices --watch`, seconds, unless --interval says otherwise.
DEVICES_WATCH_SECONDS = 1.0

# Next-up lists (next_up_choice.choose): jobs listed per busy GPU, and how far down the queue the
# scheduler looks for them each pass.
NEXT_UP_PER_GPU = 16
NEXT_UP_SCAN = 2000
# A worker whose next-up list runs short wakes the scheduler at most this often, seconds: one
# pass refills every list, so a wake-up per job would only keep the scheduler busy.
NEXT_UP_WAKE_SPACING = 0.05
# Quick scheduler passes begin at least this far apart, seconds: wake-ups that come meanwhile
# are answered by one pass. 0.02 gave about a sixth more throughput than none; 0.1 let lists run dry.
QUICK_PASS_SPACING = 0.02
# SQLite's write-ahead log: the scheduler copies it back into the database at least this often,
# seconds, and a writer's commit does only once it has grown to this many pages (about 40 MiB).
CHECKPOINT_EVERY = 0.5
WAL_BACKSTOP_PAGES = 10_000
# A quick scheduler pass reads each user's first this many pending jobs, so a next-up list holds
# no more of one user's jobs than that. Under one user's flood of short jobs a list must last
# through a worker's wake-up (NEXT_UP_WAKE_SPACING) and the pass it asks for (QUICK_PASS_SPACING,
# and the pass itself) at several hundred jobs a second: 32 let the lists run dry (an array of
# short jobs on PostgreSQL reached its GPUs by message when they did), 64 gave an array about a
# fifth more throughput on both databases, 128 no more.
HEAD_PER_USER = 64
# A whole scheduler pass runs no more often than this many times its own duration.
FULL_PASS_SHARE = 10.0

# The submitter's variables a command job gets without asking (SLURM-like: the login basics, the
# locale, and the Python environment it was submitted from). Anything else needs --env. The client
# sends these; the server checks them like any --env.
DEFAULT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
               "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "PYTHONPATH")
DEFAULT_ENV_PREFIXES = ("LC_",)
# `--env ALL`: every variable of the submitter's that a job may be given (sbatch's --export=ALL).
ENV_ALL = "ALL"
# In a command job's environment: the submitter's umask (octal), which its worker gives the job.
UMASK_VARIABLE = "GPUQ_UMASK"

# The server's API: its version prefix, the largest request body it reads (a 128 KiB command,
# 256 KiB of environment and a 1 MiB diff fit), and what a client waits for an answer.
API_PREFIX = "/v1"
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# The most of its stdin `gpuq run` sends its job at once (bytes, before base64): one request a chunk
# (service/job_input.py).
STDIN_CHUNK = 256 * 1024
CLIENT_TIMEOUT_SECONDS = 60.0
# A submit's answer lost to a server restart is asked again this many times, this far apart, with
# the same idempotency key: the server returns the jobs it already made, or makes them once.
SUBMIT_RETRIES = 5
SUBMIT_RETRY_SECONDS = 0.5
# A request may lower its own rights with this header and value: answered as for nobody in
# particular (rights.ANYONE), as the dashboard asks for its visitors. Nothing a request says raises them.
VIEW_HEADER = "X-Gpuq-View"
PUBLIC_VIEW = "public"
# The header a MUNGE credential travels in over TCP, and its scheme word.
MUNGE_SCHEME = "MUNGE"
# Seconds a `munge`/`unmunge` call may take before the request fails.
MUNGE_TIMEOUT_SECONDS = 10.0
# Where a process that must stay out of NVIDIA MPS looks for its daemon (CUDA_MPS_PIPE_DIRECTORY):
# a folder only root could make (in /), so no user can put a daemon's control there; CUDA finds
# none and makes a context of its own (checked on the lent H100). workers/mps.py says who stays out.
MPS_OUTSIDE = "/nonexistent/gpuq-outside-mps"
# The gate an allocation's shell starts behind (cli/gate.py): the interpreter's arguments it is
# started with (-I: no module of the working directory's), by which its worker tells it among the
# allocation's processes, and what the worker sends it once it has put it in the allocation's
# cgroup (workers/allocation.py).
ALLOC_GATE_ARGS = ("-I", "-m", "gpuq.cli.gate")
ALLOC_GATE_SIGNAL = signal.SIGUSR1
# What it sends instead where it could not hold the shell to the allocation's --cpus (no CPU
# cgroup): the gate says so on the terminal before the shell starts, as a command's output says it.
ALLOC_GATE_UNHELD_SIGNAL = signal.SIGUSR2
ALLOC_GATE_SIGNALS = {ALLOC_GATE_SIGNAL, ALLOC_GATE_UNHELD_SIGNAL}
# How long the gate waits for that signal before it lets the shell start anyway (an older worker).
ALLOC_GATE_SECONDS = 10.0

# What `gpuq update` changes, as the client and the server both ask for one when given none.
UPDATE_ASK = ("give something to change: --priority, --time, --name, --retries, --array-limit, --begin, --gpus, "
              "--gpu-type, --mem, --node, --exclude, --shared/--whole, --requeue/--no-requeue or --dependency")

# `--cpus`, CPU cores: the kernel's least quota is 1 ms of each 100 ms period (0.01), and no node
# has more than the most.
MIN_CPUS, MAX_CPUS = 0.01, 4096
