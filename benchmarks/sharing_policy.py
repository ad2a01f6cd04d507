"""The policy's decision pass with shared GPUs, beside the same pass with whole-GPU jobs only,
measured in one run on the same machine (the policy alone, no SQL: ``policy.decide``):

- all whole: benchmarks/queue_speed.py's pass: 10,000 pending jobs, 64 GPUs on 8 nodes (80 GiB each),
  half of them busy;
- half shared: the same queue with every other job shared (2 to 24 GiB on 1 or 2 GPUs), and a
  quarter of the GPUs already shared by a few jobs each;
- half shared, sizes all different: shared jobs of 1,000 different sizes (the pass cannot tell
  that a job fails where one of the same size just failed: its slowest case);
- half shared, full cluster: every GPU busy or shared to the brim, so nothing starts and every job
  waits behind the first (the common case of a long queue).

    python benchmarks/sharing_policy.py [--jobs 10000] [--repeat 7]

The median of ``--repeat`` passes is printed, with how many jobs each placed. Goal: under 100 ms
with half the jobs shared. Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gpuq.service import policy

GIB = 1024


def gpus(rng: random.Random, now: float, shared: bool, full: bool) -> list[policy.GpuState]:
    """8 nodes x 8 GPUs of 80 GiB: even ones busy with a whole-GPU job; with ``shared``, one in
    four partly used by shared jobs; with ``full``, the odd ones shared to the brim."""
    out = []
    for n in range(8):
        for i in range(8):
            state: dict = {}
            if i % 2 == 0:
                state = {"busy_until": now + rng.randint(60, 7200)}
            elif full or (shared and i % 4 == 1):
                held = 80 * GIB if full else rng.randint(10, 60) * GIB
                count, until = rng.randint(1, 6), rng.choice([now + rng.randint(600, 7200), float("inf")])
                # ``count`` shared jobs holding ``held`` MiB together, all until ``until``.
                state = {"shares": tuple((until, held // count + (held % count if k == 0 else 0))
                                         for k in range(count))}
            out.append(policy.GpuState(id=n * 8 + i, node=f"node{n}", index=i, queue="q", memory_total_mib=80 * GIB,
                                       **state))
    return out


def jobs(rng: random.Random, now: float, n_jobs: int, shared: bool, sizes: list[int]) -> list[policy.JobRequest]:
    """queue_speed.py's queue, drawn in its order; with ``shared``, every other job shared, of one
    of ``sizes`` (MiB)."""
    out = []
    for j in range(n_jobs):
        share = shared and j % 2 == 1
        user = f"user{rng.randint(0, 19)}"
        n_gpus = rng.choice([1, 1, 1, 2] if share else [1, 1, 1, 2, 4, 8])
        priority = rng.choice([0, 0, 0, 5])
        limit = rng.choice([None, 3600])
        mem = rng.choice(sizes) if share else rng.choice([None, 20480])
        out.append(policy.JobRequest(id=j, user=user, gpus=n_gpus, priority=priority, submitted=now - j,
                                     time_limit_s=limit, mem_mib=mem, shared=share))
    return out


def measure(name: str, snap: policy.QueueState, repeat: int) -> None:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        d = policy.decide(snap)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1000
    shared = sum(p.shared for p in d.placements)
    print(f"{name:<38} {ms:6.1f} ms (goal 100 ms: {ms / 100:.2f}x of it), {len(d.placements)} placed "
          f"({shared} shared), reservation: {'job ' + str(d.reservation.job_id) if d.reservation else 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    now = time.time()
    sizes = [2 * GIB, 4 * GIB, 8 * GIB, 16 * GIB, 24 * GIB]
    every_size = [1024 + 23 * k for k in range(1000)]
    print(f"decision pass, {args.jobs} pending, 64 GPUs of 80 GiB on 8 nodes (policy alone, median of {args.repeat}):")
    cases = [("all whole", False, False, sizes), ("half shared", True, False, sizes),
             ("half shared, sizes all different", True, False, every_size),
             ("half shared, full cluster", True, True, sizes)]
    for name, shared, full, job_sizes in cases:
        rng = random.Random(0)  # all whole: queue_speed.py's very snapshot
        on = gpus(rng, now, shared, full)
        queue = jobs(rng, now, args.jobs, shared, job_sizes)
        hours = {f"user{u}": rng.random() * 100 for u in range(20)}
        snap = policy.QueueState(now, queue, on, gpu_hours=hours)
        measure(name, snap, args.repeat)


if __name__ == "__main__":
    main()
