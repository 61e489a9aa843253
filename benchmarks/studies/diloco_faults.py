"""Fault-tolerant DiLoCo (#32 item 5): a replica SIGKILLed in its inner steps or mid-exchange, 5 runs each.

    python -m benchmarks diloco_faults [--runs 5] [--stores tcp,etcd] [--scenarios inner,exchange,...]

from the repository root (etcd runs need ``make etcd``).

Each run is the job of
tests/test_diloco_elastic.py (tests/jobs/diloco_worker.py; the replicas and the replay are the
tests' own, so the benchmark checks what the test checks): three replicas of a small MLP, AdamW
inner, Nesterov outer, H = 4, 20 ms of simulated compute per inner step; replica c is SIGKILLed
either before inner step 9 (in the inner phase of outer step 2) or in outer step 2's exchange
(after its reduce-scatter, before its all-gather). Streaming (F = 2, delay 1: fragment k % 2's
exchange starts after inner step 2 (k + 1) on a thread and lands one inner step later): c is
killed after outer step 4's exchange started, before it landed ("streaming-in-flight", the
paper's merge), or in outer step 3's exchange ("streaming-exchange", merge="keep_inner_steps").
Once c has exited, its replacement c2 is
started in its slot; the run goes on until c2 took part in two outer steps. A run counts as
passed when tests/diloco_elastic_support.py's ``check`` holds: both survivors in every committed
outer step (no inner step lost), the cut-off outer step averaged over the two survivors, c2 healed from a
survivor and contributing, and every replica's parameters and theta_global bitwise those of the
one-process torch replay (which replays the streaming merges too).

Reported per run: the survivors' stall (how much longer the cut-off outer step took than the
median outer step: detecting the death, settling, forming the next generation, the redo), the
heal (the admitting reconfiguration on the members: forming the generation with c2 and sending
it the state), and c2's restart to its first outer step (interpreter and import, waiting to be
admitted at the next outer step, the heal).

Writes ``results/YYYY-MM-DD-diloco-faults.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "jobs")]

from benchmarks.lib import common  # noqa: E402
from diloco_elastic_support import STEPS, DiLoCoJob, H, check  # noqa: E402
from gradsync.elastic.etcd_cluster import LocalCluster, find_binary  # noqa: E402


class Scenario(NamedTuple):
    fault: str
    dead_at: int  # the outer step the death cuts off
    options: dict  # the worker's DiLoCo settings besides H


SCENARIOS = {
    "inner": Scenario(f"inner:{2 * H + 1}", 2, {}),
    "exchange": Scenario("exchange:2", 2, {}),
    # Streaming: F = 2, delay 1 (fragment k % 2 starts after inner step 2 (k + 1), lands a step later).
    "streaming-in-flight": Scenario("inner:10", 4, {"fragments": 2, "delay": 1}),
    "streaming-exchange": Scenario("exchange:3", 3, {"fragments": 2, "delay": 1, "merge": "keep_inner_steps"}),
}
SLEEP_S = 0.02


def one_run(scenario: str, store: str, cluster: LocalCluster | None) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"diloco-faults-{scenario}-{store}-"))
    run_id = f"{scenario}-{store}-{uuid.uuid4().hex[:6]}"
    case = SCENARIOS[scenario]
    job = DiLoCoJob(out, run_id, cluster, sync_every=H, steps=STEPS, await_joiner="", sleep=SLEEP_S, **case.options)
    row = {"scenario": scenario, "store": store, "out": str(out)}
    try:
        job.start("a", slot=0)
        job.start("b", slot=1)
        job.wait_arrivals(2)
        job.start("c", slot=2, fault=case.fault)
        job.wait_for_exit("c", timeout_s=60)
        restarted = time.time()
        job.start("c2", slot=2)
        results = job.finish(["a", "b", "c2"], timeout_s=120)
        check(out, results, dead_at=case.dead_at)
        row["passed"] = True
    except Exception:  # noqa: BLE001 - a failed run is reported, not hidden
        row["passed"], row["why"] = False, traceback.format_exc(limit=3)[-600:]
        return row
    commits = [json.loads(line) for line in (out / "a.jsonl").read_text().splitlines()]
    times = {c["outer_step"]: c["t"] for c in commits if "outer_step" in c}
    gaps = {k: times[k] - times[k - 1] for k in sorted(times) if k - 1 in times}
    usual = statistics.median(g for k, g in gaps.items() if k != case.dead_at)
    row["stall_s"] = gaps[case.dead_at] - usual
    row["usual_outer_s"] = usual
    by_name = {r["name"]: r for r in results}
    admitting = [h for h in by_name["a"]["history"] if h["reason"].startswith("admitting")]
    row["heal_s"] = admitting[0]["seconds"]
    joined = next(json.loads(line) for line in (out / "c2.jsonl").read_text().splitlines() if "joined" in line)
    row["restart_to_member_s"] = joined["t"] - restarted
    row["outer_steps"] = by_name["a"]["outer_steps"]
    row["redone"] = by_name["a"]["redone"]
    return row


def report(rows: list[dict], runs: int, stores: list[str], scenarios: list[str]) -> Path:
    lines = [f"# Fault-tolerant DiLoCo: a replica SIGKILLed, {runs} runs per case ({common.today()})", ""]
    command = f"python -m benchmarks diloco_faults --runs {runs} --stores {','.join(stores)}"
    command += f" --scenarios {','.join(scenarios)}"
    lines += [f"Command: `{command}`", ""]
    lines += [f"- commit {common.revision()}; load average before: {common.loadavg()}", ""]
    lines += ["- heartbeat timeout 1.5 s, collective timeout 5 s (the worker's `elastic.init` arguments)", ""]
    lines += [(__doc__ or "").split("\n\n", 3)[3].split("Writes")[0].strip(), ""]
    lines += [
        "| case | store | passed | survivors' stall (s) | heal (s) | c2 restart -> member (s) | usual outer step (s) |"
    ]
    lines += ["|---|---|---|---|---|---|---|"]
    for scenario in scenarios:
        for store in stores:
            case = [r for r in rows if r["scenario"] == scenario and r["store"] == store]
            good = [r for r in case if r["passed"]]

            def span(key: str, good: list[dict] = good) -> str:
                values = [r[key] for r in good]
                if not values:
                    return "-"
                return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})"

            lines.append(
                f"| {scenario} | {store} | {len(good)} of {len(case)} | {span('stall_s')} | {span('heal_s')} | "
                f"{span('restart_to_member_s')} | {span('usual_outer_s')} |"
            )
    lines += ["", "Every run:", "", "| case | store | passed | stall | heal | restart -> member | outer steps |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["passed"]:
            lines.append(
                f"| {r['scenario']} | {r['store']} | yes | {r['stall_s']:.2f} | {r['heal_s']:.2f} | "
                f"{r['restart_to_member_s']:.2f} | {r['outer_steps']} |"
            )
        else:
            lines.append(f"| {r['scenario']} | {r['store']} | **no** ({r['out']}) | | | | |")
    failed = [r for r in rows if not r["passed"]]
    for r in failed:
        lines += ["", f"Failed run {r['out']}:", "", "```", r["why"], "```"]
    path = common.report_path("diloco-faults")
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stores", default="tcp,etcd")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    args = parser.parse_args()
    stores = args.stores.split(",")
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose among {', '.join(SCENARIOS)}")
    cluster = None
    if "etcd" in stores:
        binary = find_binary(REPO)
        if binary is None:
            raise SystemExit("no etcd binary: run `make etcd` first, or pass --stores tcp")
        cluster = LocalCluster(3, Path(tempfile.mkdtemp(prefix="diloco-faults-etcd-")), binary, []).start(timeout_s=30)
    rows = []
    try:
        for index in range(args.runs):
            for scenario in scenarios:
                for store in stores:
                    row = one_run(scenario, store, cluster if store == "etcd" else None)
                    print(json.dumps({"run": index, **row}), flush=True)
                    rows.append(row)
    finally:
        if cluster is not None:
            cluster.stop()
    print(report(rows, args.runs, stores, scenarios))


if __name__ == "__main__":
    main()
