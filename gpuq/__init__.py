"""gpuq: the job queue in front of a shared lab's GPUs.

The code lives in the top-level folders ``service/``, ``workers/``, ``cli/`` and
``migrations/``, installed as ``gpuq.service``, ``gpuq.workers``, ``gpuq.cli`` and
``gpuq.migrations``.
"""

__version__ = "0.1.0"
