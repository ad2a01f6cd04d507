"""The one error hierarchy. The CLI turns each into a one-line message and its exit code."""

from gpuq.service import constants as c


class GpuqError(Exception):
    """Root of every error gpuq raises on purpose."""

    exit_code = c.EXIT_SOFTWARE


class ConfigError(GpuqError):
    """A setting is malformed or missing."""

    exit_code = c.EXIT_CONFIG


class InvalidSpec(GpuqError):
    """A job spec or a command line is not acceptable; nothing was written."""

    exit_code = c.EXIT_USAGE


class JobNotFound(GpuqError):
    """No job has that id."""

    exit_code = c.EXIT_NOT_FOUND


class StateConflict(GpuqError):
    """The job is not in a state that allows the request (cancelling a finished job)."""

    exit_code = c.EXIT_CONFLICT


class NotAllowed(GpuqError):
    """The job belongs to another user and the caller is not an admin."""

    exit_code = c.EXIT_NOT_ALLOWED


class DuplicateSubmission(GpuqError):
    """A submit's idempotency key was used already: its jobs exist, and nothing new was written."""

    exit_code = c.EXIT_CONFLICT

    def __init__(self, key: str, job_ids: list[int] | None) -> None:
        super().__init__(f"submission {key} was made already")
        self.job_ids = job_ids


class OverLimit(GpuqError):
    """A per-user limit (pending jobs) refuses the request for now; nothing was written."""

    exit_code = c.EXIT_OVER_LIMIT


class Unreachable(GpuqError):
    """The database or the broker did not answer; the message names which URL (password masked)."""

    exit_code = c.EXIT_UNAVAILABLE


class SchemaOutOfDate(GpuqError):
    """The database has not been upgraded to this gpuq's schema (`gpuq db upgrade`)."""

    exit_code = c.EXIT_CONFIG


class StackError(GpuqError):
    """The local stack (`gpuq up` / `gpuq down`) could not be started or stopped."""

    exit_code = c.EXIT_UNAVAILABLE


class JobCancelled(GpuqError):
    """Raised inside a running built-in workload when its job was cancelled."""

    exit_code = c.EXIT_JOB_FAILED


class BugError(GpuqError):
    """gpuq broke its own rules (a move its lifecycle table does not allow): a bug to report."""

    exit_code = c.EXIT_SOFTWARE
