"""Fault-tolerant DiLoCo over islands on the real task (#44 item 6): an island member SIGKILLed, or NaN-poisoned.

    python -m benchmarks diloco_island_faults [--runs 5] [--stores tcp,etcd] [--steps 200] [--sync-every 25]

from the repository root, as root (network namespaces; etcd runs need ``make etcd``).

The task is benchmarks/studies/diloco_task.py's character LM (0.44 M parameters, AdamW inner, Nesterov
outer 0.7 / 0.9, 8 sequences per process per inner step) under ``FaultTolerantDiLoCo``: three islands
A, B, C of two processes, each island a gradsync DDP over its island group, one
``torchrun --nproc-per-node 2 --max-restarts 1`` per island (benchmarks/studies/diloco_island_worker.py).
Each island runs in a network namespace of its own: its members talk over that namespace's loopback,
unshaped; every byte between islands, and between an island and the store, passes two veth ends shaped
to ``--link`` (100 Mbit/s, tc tbf) on a bridge (lib/link.py's [Note: islands behind one link]). The store
(a TCPStore hosted by this script, or a 3-member etcd cluster) listens on the bridge's own namespace.

Cases (C's member 1 meets the fault in its first incarnation; H = ``--sync-every``):
- undisturbed: the reference, once per store;
- inner: SIGKILLed before inner step 2H + H/2, in the inner phase of outer step 2;
- exchange: SIGKILLed in outer step 2's exchange, after its reduce-scatter across the islands, before
  the all-gather;
- nan: a NaN written into its first parameter before inner step 3H - 1 (the island's DDP spreads it
  to both members within that step): its outer gradient at outer step 2 is not finite.
A run passes when (diloco_island_runs.check): the torchruns end well; every process logged the same
contributors and exclusions at every committed outer step, and a finite theta_global at every one;
A and B took every inner step and are in every committed outer step (no surviving island lost an inner
step); ``replicas_identical()`` on every process; for a death, outer step 2 averaged A and B only, C
restarted, was healed and contributes to every outer step from its first; for the NaN, C was left out
of outer step 2 only, named in ``run.history``, and not restarted; undisturbed: nothing left out.

Measured per run, on A's member 0: the survivors' stall (how much longer the ``step()`` call that committed
the cut-off outer step took than the median outer step's call: detecting the death, settling, forming the
next generation, the redo; the round's wall-clock is reported beside it, but on two cores four trainers
step faster than six while C is down, which hides part of a stall there), C's restart (the death to its
new incarnation's first line, with torch imported; to its heal; to the commit of its first
contribution), the heal on the survivors (the admitting outer step's call over the median), and the
validation loss of theta_global after the last outer step (10 held-out batches of 32, diloco_task's)
against the undisturbed run of the same store at equal inner steps.

Writes ``results/YYYY-MM-DD-diloco-island-faults.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import common, launch, link
from benchmarks.studies import diloco_island_report as report
from benchmarks.studies.diloco_island_runs import HUB, ISLANDS, Case, HubCluster, one_run


def cases(h: int) -> dict[str, Case]:
    return {
        "undisturbed": Case("undisturbed", "", -1),
        "inner": Case("inner", f"inner:{2 * h + h // 2}", 2),
        "exchange": Case("exchange", "exchange:2", 2),
        "nan": Case("nan", f"nan:{3 * h - 1}", 2),
    }


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per death case and store")
    parser.add_argument("--stores", default="tcp,etcd")
    parser.add_argument("--cases", default="undisturbed,nan,inner,exchange")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=25)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--link", default="100mbit", help="the rate between islands (tc's spelling)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds one run may take")
    parser.add_argument("--rewrite", metavar="LOG", help="only write the report again, from this study's output")
    parser.add_argument("--inside", default="", help=argparse.SUPPRESS)  # the islands' namespaces, in the hub
    return parser.parse_args()


def command(argv: list[str]) -> str:
    """The command that reproduces the run, for the report (without the namespaces' and rewriting's arguments)."""
    kept = [a for i, a in enumerate(argv) if a not in ("--inside", "--rewrite") and argv[i - 1 : i] not in
            (["--inside"], ["--rewrite"])]  # fmt: skip
    return launch.command_line(kept)


def rewrite(args: argparse.Namespace) -> None:
    """The report again from a finished study's printed rows (their folders still in place), e.g. after the
    report's layout changed; the machine load is taken from the report being replaced."""
    rows = [json.loads(line) for line in Path(args.rewrite).read_text().splitlines() if line.startswith('{"run"')]
    for row in rows:
        row["losses"] = report.losses(Path(row["out"]), args.sync_every) if row["codes"] == [0, 0, 0] else []
    old = report.path_of().read_text() if report.path_of().exists() else ""
    load = next((line.split(": ", 1)[1] for line in old.splitlines() if line.startswith("- machine load:")), "")
    load = load.split(". **The machine")[0] or "not recorded"
    torch_line = next((line for line in old.splitlines() if line.startswith("- torch ")), "")
    revision = torch_line.split("(commit ", 1)[1].rsplit("); ", 1)[0] if "(commit " in torch_line else "unknown"
    os.environ.update({link.ENV_VAR: link.parse_rate(args.link), link.TOPOLOGY_VAR: "islands of 2"})
    print(report.write(rows, args, load, command(sys.argv[1:]), __doc__ or "", revision))


def main() -> None:
    args = parse()
    if args.rewrite:
        return rewrite(args)
    if not args.inside:
        raise SystemExit(outside(args))
    namespaces = args.inside.split(",")
    stores = args.stores.split(",")
    table = cases(args.sync_every)
    chosen = [table[name] for name in args.cases.split(",")]
    options = ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--batch", str(args.batch)]
    cluster = None
    if "etcd" in stores:
        from gradsync.elastic.etcd_cluster import find_binary

        binary = find_binary(launch.REPO)
        if binary is None:
            raise SystemExit("no etcd binary: run `make etcd` first, or pass --stores tcp")
        cluster = HubCluster(3, None, binary, []).start(timeout_s=30)
    load, revision = Load(), common.revision()  # the code the runs use, before anyone changes it
    rows: list[dict[str, Any]] = []
    path = None
    try:
        for case, index in schedule(chosen, args.runs):
            for store in stores:
                row = one_run(case, store, namespaces, cluster if store == "etcd" else None, options, args.timeout)
                row["losses"] = report.losses(Path(row["out"]), args.sync_every) if row["codes"] == [0, 0, 0] else []
                print(json.dumps({"run": index, **{k: v for k, v in row.items() if k != "losses"}}), flush=True)
                rows.append(row)
                # rewritten after every run: a study cut short still leaves the runs it finished
                path = report.write(rows, args, load.describe(), command(sys.argv[1:]), __doc__ or "", revision)
    finally:
        if cluster is not None:
            cluster.stop()
    print(path)


def schedule(chosen: list[Case], runs: int) -> list[tuple[Case, int]]:
    """The reference and the NaN case once, then the death cases in rotation, ``runs`` times."""
    once = [(c, 0) for c in chosen if c.name in ("undisturbed", "nan")]
    deaths = [c for c in chosen if c.name not in ("undisturbed", "nan")]
    return once + [(c, i) for i in range(runs) for c in deaths]


class Load:
    """The machine's load while the study ran: what other processes used, beside ours (other agents share it)."""

    def __init__(self) -> None:
        self.start_avg, self.start_wall, self.start_busy = common.loadavg(), time.monotonic(), busy_cpu_s()

    def describe(self) -> str:
        wall = time.monotonic() - self.start_wall
        ours = resource.getrusage(resource.RUSAGE_CHILDREN) + resource.getrusage(resource.RUSAGE_SELF)
        own = ours[0] + ours[1]
        others = max(busy_cpu_s() - self.start_busy - own, 0.0)
        return (f"load average (1, 5, 15 min) {self.start_avg} at the start, {common.loadavg()} at the end; other "
                f"processes used {others:.0f} CPU-s during the {wall:.0f} s, {others / wall:.2f} cores on average "
                "(our six trainers need the two cores alone)")  # fmt: skip


def busy_cpu_s() -> float:
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def outside(args: argparse.Namespace) -> int:
    """Make the islands' namespaces and the hub, and run this study again inside the hub; its exit status."""
    problem = link.missing()
    if problem:
        raise SystemExit(f"diloco_island_faults: a shaped link {problem}")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with link.switched_namespaces(args.link, len(ISLANDS)) as names:
            hub = hub_of(names)
            subprocess.run(["ip", "-n", hub, "addr", "add", f"{HUB}/24", "dev", "br0"], check=True)
            subprocess.run(["ip", "-n", hub, "link", "set", "lo", "up"], check=True)
            argv = ["ip", "netns", "exec", hub, *launch.python_m(launch.main_module(), sys.argv[1:])]
            env = launch.env(**{link.ENV_VAR: link.parse_rate(args.link), link.TOPOLOGY_VAR: "islands of 2"})
            child = subprocess.Popen([*argv, "--inside", ",".join(names)], env=env, start_new_session=True)
            try:
                return child.wait()
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGTERM)
                    child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def hub_of(names: list[str]) -> str:
    """The bridge's namespace of ``link.switched_namespaces`` (it yields the ranks' only): the one named
    like them, ``gs-hub-<pid>-<tag>`` beside ``gs-rank<r>-<pid>-<tag>``."""
    tag = names[0].split("-", 2)[2]
    hub = f"gs-hub-{tag}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    if hub not in listed.split():
        raise RuntimeError(f"no namespace {hub} beside {names}: lib/link.py's naming changed")
    return hub


if __name__ == "__main__":
    main()
