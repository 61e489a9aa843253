"""One run of benchmarks/studies/diloco_island_faults.py: three islands started, waited for, read back and checked.

Runs inside the hub namespace of that study (the store is hosted here, at ``HUB``); each island is one
``torchrun --nproc-per-node 2 --max-restarts 1`` of benchmarks/studies/diloco_island_worker.py started in
its own namespace with ``ip netns exec``. ``one_run`` returns a row: whether the run did what the issue
asks of its case (the checks in ``check``), and what it measured.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import launch
from gradsync.elastic.etcd_cluster import LocalCluster, Member

HUB = "10.77.0.254"  # the hub's bridge: where the store (TCPStore or etcd) listens, behind every island's link
ISLANDS = ["A", "B", "C"]  # slots 0, 1, 2; C is the one that meets the fault
VICTIM = 1  # C's member that dies (or is poisoned)
WORKER = "benchmarks.studies.diloco_island_worker"


@dataclass(frozen=True)
class Case:
    name: str
    fault: str  # the worker's --fault ("" for the undisturbed run)
    cut_at: int  # the outer step the fault cuts C out of (-1: none)


class HubCluster(LocalCluster):
    """A LocalCluster whose members also listen on the hub's address, so the islands' namespaces reach them
    (LocalCluster listens on 127.0.0.1 only; its peers and its own status checks stay there)."""

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"{HUB}:{m.client_port}" for m in self.members)

    def start_member(self, member: Member) -> None:
        peers = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        state = "existing" if member.data_dir.exists() else "new"
        argv = [
            str(self.binary), f"--name={member.name}", f"--data-dir={member.data_dir}",
            f"--listen-client-urls=http://127.0.0.1:{member.client_port},http://{HUB}:{member.client_port}",
            f"--advertise-client-urls=http://{HUB}:{member.client_port}",
            f"--listen-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--initial-cluster={peers}", f"--initial-cluster-state={state}", "--initial-cluster-token=gradsync",
            *self.extra_flags,
        ]  # fmt: skip
        log = member.log.open("a")
        member.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_island(namespace: str, slot: int, out: Path, store: str, run_id: str, options: list[str]) -> Any:
    name = ISLANDS[slot]
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1", "-m", WORKER]
    argv += ["--store", store, "--run-id", run_id, "--island", name, "--slot", str(slot), "--out", str(out)]
    argv += [*options, "--victim", str(VICTIM)]
    env = launch.env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")  # gloo on the veth: the shaped link
    log = (out / f"{name}.log").open("w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=launch.REPO,
                            start_new_session=True)  # fmt: skip


def wait_all(procs: list[Any], timeout_s: float) -> list[int | None]:
    """Each torchrun's exit status; on the timeout every one still running is killed with its workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def one_run(case: Case, store_kind: str, namespaces: list[str], cluster: HubCluster | None, options: list[str],
            timeout_s: float) -> dict[str, Any]:  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix=f"diloco-island-{case.name}-{store_kind}-"))
    run_id = f"{case.name}-{store_kind}-{uuid.uuid4().hex[:6]}"
    hosted = None
    if cluster is None:
        from gradsync.elastic import serve

        hosted = serve(HUB, 0)  # a TCPStore per run, in this process: it outlives every trainer
        address = f"{HUB}:{hosted.port}"
    else:
        address = cluster.address
    fault = ["--fault", case.fault] if case.fault else []
    started = time.time()
    procs = [
        start_island(namespaces[s], s, out, address, run_id, options + (fault if s == 2 else [])) for s in range(3)
    ]
    codes = wait_all(procs, timeout_s)
    row: dict[str, Any] = {"case": case.name, "store": store_kind, "out": str(out), "codes": codes,
                           "wall_s": time.time() - started}  # fmt: skip
    try:
        if any(code != 0 for code in codes):
            raise AssertionError(f"torchrun exit codes {codes}; logs in {out}")
        row.update(check(case, read(out)))
        row["passed"] = True
    except Exception as error:  # noqa: BLE001 - a failed run is reported with its reason, not hidden
        row["passed"], row["why"] = False, f"{type(error).__name__}: {error}"[-800:]
    del hosted
    return row


def read(out: Path) -> dict[str, Any]:
    """Every process's log lines (by file stem) and results."""
    logs = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in out.glob("*.jsonl")}
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*-m*-r*.json")}
    return {"out": out, "logs": logs, "results": results}


def check(case: Case, run: dict[str, Any]) -> dict[str, Any]:
    """What the issue asks of the case (an AssertionError names what failed), and the run's measures."""
    logs, results = run["logs"], run["results"]
    survivors = ["A-m0-r0", "A-m1-r0", "B-m0-r0", "B-m1-r0"]
    assert all(s in results for s in survivors), f"survivors' results missing: {sorted(results)}"
    ids = {name[0]: logs[f"{name[0]}-m0-r0"][-1]["uuid"] for name in ("A", "B", "C")}
    commits = {e["outer_step"]: e for e in logs["A-m0-r0"] if "contributors" in e}
    steps = results["A-m0-r0"]["step"]
    count = len(commits)
    assert sorted(commits) == list(range(count)), f"committed outer steps have gaps: {sorted(commits)}"
    for name, entries in logs.items():  # every process agrees on every commit, theta_global always finite
        for e in entries:
            if "contributors" in e:  # a committed outer step
                assert e["finite"], f"{name}: a non-finite value in theta_global at outer step {e['outer_step']}"
                mine = commits[e["outer_step"]]
                assert (e["contributors"], e["excluded"]) == (mine["contributors"], mine["excluded"]), (name, e)
    # No surviving island lost an inner step: each survivor took every inner step, and every committed outer
    # step averaged A's and B's outer gradients.
    lost = {s: steps - results[s]["inner_steps"] for s in survivors}
    assert not any(lost.values()), f"survivors' inner steps not taken: {lost}"
    assert all({ids["A"], ids["B"]} <= set(c["contributors"]) for c in commits.values()), commits
    assert all(r["identical"] for r in results.values()), "theta_global differs between processes"
    row = {"outer_steps": count, "inner_steps": steps, "survivor_inner_steps": results["A-m0-r0"]["inner_steps"]}
    row["c_contributed"] = sum(1 for c in commits.values() if len(c["contributors"]) == 3)
    if case.fault.startswith(("inner", "exchange")):
        row.update(death(case, logs, commits, ids))
    elif case.fault.startswith("nan"):
        row.update(poisoned(case, logs, commits, ids, results))
    else:
        assert all(len(c["contributors"]) == 3 and not c["excluded"] for c in commits.values()), commits
    return row


def death(case: Case, logs: dict[str, list[dict]], commits: dict[int, dict], ids: dict[str, str]) -> dict[str, Any]:
    """C's member died: the cut-off step averaged A and B only, C restarted, was healed and contributes."""
    cut = case.cut_at
    assert sorted(commits[cut]["contributors"]) == sorted([ids["A"], ids["B"]]), commits[cut]
    died = next(e for e in logs[f"C-m{VICTIM}-r0"] if "died" in e)
    assert "C-m0-r1" in logs and "C-m1-r1" in logs, f"island C was not restarted: {sorted(logs)}"
    joined = next(e for e in logs["C-m0-r1"] if "joined" in e)
    new = joined["uuid"]
    first = min(k for k, c in commits.items() if new in c["contributors"])
    assert all(new in commits[k]["contributors"] for k in range(first, len(commits))), commits
    assert first == joined["joined"], (first, joined)
    # The stall is measured on the step() call that committed the cut-off outer step (detecting the death,
    # settling, the next generation, the redo), against the median call: the round's wall-clock is not a
    # fair measure on two cores, where four trainers step faster than six while C is down.
    calls = {k: c["step_s"] for k, c in commits.items()}
    usual = statistics.median(g for k, g in calls.items() if k not in (cut, first - 1))
    times = {k: c["t"] for k, c in commits.items()}
    rounds = {k: times[k] - times[k - 1] for k in times if k - 1 in times}
    restarted = min(e["t"] for e in logs["C-m0-r1"] + logs["C-m1-r1"] if "started" in e)
    return {
        "stall_s": calls[cut] - usual,
        "usual_outer_s": usual,
        "heal_call_s": calls[first - 1] - usual,  # the outer step whose commit admitted C: its heal
        "round_vs_median_s": rounds[cut] - statistics.median(g for k, g in rounds.items() if k not in (cut, first - 1)),
        "restart_s": restarted - died["t"],  # the death to the new incarnation's first line (torch imported)
        "to_joined_s": joined["t"] - died["t"],
        "to_contribution_s": times[first] - died["t"],
        "first_contribution": first,
        "healed_from": joined["source"],
        "c_steps_lost": joined["step"] - cut * (commits[1]["step"] - commits[0]["step"]),
    }


def poisoned(case: Case, logs: dict[str, list[dict]], commits: dict[int, dict], ids: dict[str, str],
             results: dict[str, dict]) -> dict[str, Any]:  # fmt: skip
    """C's parameters got a NaN: left out of the cut-off step (named), C not restarted, contributing after."""
    cut = case.cut_at
    assert commits[cut]["excluded"] == [ids["C"]], commits[cut]
    assert sorted(commits[cut]["contributors"]) == sorted([ids["A"], ids["B"]]), commits[cut]
    assert all(not c["excluded"] for k, c in commits.items() if k != cut), commits
    assert all(len(c["contributors"]) == 3 for k, c in commits.items() if k != cut), commits
    assert not any(name.endswith("-r1") for name in logs), f"island C restarted: {sorted(logs)}"
    named = [h for h in results["A-m0-r0"]["history"] if h["reason"] == "bad contribution left out"]
    assert len(named) == 1 and named[0]["excluded"] == ["C"] and named[0]["outer_step"] == cut, named
    return {"named": f"{named[0]['why']}, parameter {named[0]['parameters'][0]!r}, ranks {named[0]['ranks']}"}
