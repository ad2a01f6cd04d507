"""What recording the code costs `gpuq submit`, in one run: git capture (commit, dirtiness, diff)
and a --snapshot copy, on this repository and on a generated work tree of many files.

    python benchmarks/snapshot_cost.py [--files 5000] [--file-kib 16] [--runs 5]

Calls the same functions `gpuq submit` calls (service/snapshot.py), in a temporary directory;
medians of ``--runs``. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from gpuq.service import snapshot
from gpuq.service.settings import Settings

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.org", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@example.org"}


def generated_tree(root: Path, files: int, kib: int) -> Path:
    repo = root / "tree"
    for i in range(files):
        path = repo / f"pkg{i % 50}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(kib * 512).hex().encode())
    (repo / ".gitignore").write_text("data/\n")
    (repo / "data").mkdir()
    (repo / "data" / "ignored.bin").write_bytes(b"z" * (64 << 20))
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=GIT_ENV)
    (repo / "pkg0" / "mod0.py").write_text("changed\n")
    return repo


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(label: str, repo: Path, settings: Settings, runs: int) -> None:
    git = snapshot.capture(str(repo), settings.git_diff_max_bytes)
    assert git is not None
    capture_ms = median_ms(lambda: snapshot.capture(str(repo), settings.git_diff_max_bytes), runs)
    copy_ms = median_ms(lambda: snapshot.stage(settings, str(repo), git).discard(), runs)
    staged = snapshot.stage(settings, str(repo), git)
    count = sum(len(f) for _, _, f in os.walk(staged.path))
    size = sum(p.stat().st_size for p in staged.path.rglob("*") if p.is_file())
    staged.discard()
    print(f"{label}: {count} files, {size / 2**20:.1f} MiB copied; git capture {capture_ms:.0f} ms, "
          f"snapshot (copy + remove) {copy_ms:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--file-kib", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home")
        measure("this repository", Path(__file__).resolve().parent.parent, settings, args.runs)
        measure("generated tree", generated_tree(Path(tmp), args.files, args.file_kib), settings, args.runs)


if __name__ == "__main__":
    main()
