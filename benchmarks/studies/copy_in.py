"""Copying gradients into a bucket and dividing them: which way is faster, by gradient size.

Run from the repository root (single process, about half a minute):

    python -m benchmarks copy_in

which is exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.copy_in``.

gradsync copies each bucket's gradients into its flat buffer and divides by the world size
before the all-reduce ([Note: one pass per gradient] in ``src/gradsync/bucket_set.py``). Two
ways to do that, timed here on one thread for buckets of equally sized gradients:

- ``foreach + div_``: one ``torch._foreach_copy_`` into the views, then one ``div_`` of the
  flat buffer: two calls per bucket, but two passes over memory;
- ``div(out=view)``: one ``torch.div(grad, w, out=view)`` per gradient: one pass, one
  Python call per gradient.

The crossover sets ``FUSE_DIVISION_MIN_NUMEL`` in ``grad_bucket.py``. Writes
``benchmarks/results/YYYY-MM-DD-copy-in.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import gradsync
from benchmarks.lib import launch
from benchmarks.lib.common import processor, report_path, revision

SIZES = [1024, 4096, 16384, 65536, 262144, 1 << 20, 1 << 24]  # elements per gradient
MIN_BUCKET_NUMEL = 1 << 22  # 16 MiB of fp32 per bucket at least, so caches do not hold it
REPEATS = 7


def timed(fn, repeats: int = REPEATS) -> float:  # noqa: ANN001
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(numel: int) -> tuple[int, float, float]:
    count = max(1, MIN_BUCKET_NUMEL // numel)
    grads = [torch.randn(numel) for _ in range(count)]
    flat = torch.empty(numel * count)
    views = list(flat.split(numel))

    def two_passes() -> None:
        torch._foreach_copy_(views, grads)
        flat.div_(2.0)

    def one_pass() -> None:
        for view, grad in zip(views, grads):
            torch.div(grad, 2.0, out=view)

    return count, timed(two_passes), timed(one_pass)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    lines = [
        f"# Copy-in and division: two passes vs one call per gradient ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {revision()}), {os.cpu_count()} CPU cores ({processor()}), 1 torch thread, fp32, divisor 2, "
        f"median of {REPEATS}",
        "",
        "| elements per gradient | gradients per bucket | foreach + div_ ms | div(out=view) ms | one-pass / two-pass |",
        "|---:|---:|---:|---:|---:|",
    ]
    for numel in SIZES:
        count, two, one = measure(numel)
        lines.append(f"| {numel:,} | {count} | {two * 1e3:.2f} | {one * 1e3:.2f} | {one / two:.2f} |")
        print(lines[-1], flush=True)
    path = report_path("copy-in")
    path.write_text("\n".join(lines) + "\n")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
