"""The sweep's report: targets, distributions, the chart of ratio against compute per byte, per-shape tables.

Rank 0 calls ``write`` once every shape is measured (studies/sweep.py); the arithmetic is in
sweep_stats.py.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib import contenders, sweep_stats
from benchmarks.lib.common import MachineLoad, environment_lines, loadavg, mib, report_path, today
from benchmarks.lib.sweep_stats import FIRST_GRADIENT, FORWARD, NO_COMM, RAW, Interval

EXACT = ("gradsync", "gradsync_auto", "torch_ddp")
GRADSYNC_HOOKS = ("gradsync_powersgd_r1", "gradsync_powersgd_r4", "gradsync_int8")
TORCH_HOOKS = ("torch_powersgd_r1", "torch_powersgd_r4")
HOOKS = (*GRADSYNC_HOOKS, *TORCH_HOOKS)
ALONE = contenders.ALONE  # the CPU floors: gradsync and its PowerSGD r=1 over a group of one rank
CONTROLS = sweep_stats.CONTROLS  # the A/A control: reference -> its second instance
CONTENDERS = (NO_COMM, *EXACT, *HOOKS, *CONTROLS.values())
DESCRIPTIONS = {**contenders.DESCRIPTIONS, **contenders.SWEEP_DESCRIPTIONS}


@dataclass
class ShapeResult:
    name: str
    description: str
    tensors: int
    params: int
    nbytes: int
    iters: int
    samples: dict[str, list[float]]
    # gradsync's defaults, from ddp.stats() over the timed iterations (slowest rank): buckets, comm, exposed comm.
    buckets: int = 0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    other_cores: float = 0.0  # CPU other processes used while this shape was measured
    waited_s: float = 0.0  # for a quiet machine, before measuring (lib/common.py's wait_for_quiet)
    nonfinite: list[str] = field(default_factory=list)  # contenders whose weights went NaN/inf on some rank
    flat_cpu_s: float | None = None  # the flat all-reduce's process CPU time (median, slowest rank); None: not measured

    def median_ms(self, name: str) -> float:
        return statistics.median(self.samples[name]) * 1e3

    def compute_per_byte(self) -> float:
        """The no-communication step's median, ms per MiB of gradients."""
        return self.median_ms(NO_COMM) / (self.nbytes / 2**20)

    def bound_ms(self) -> float:
        return max(self.median_ms(NO_COMM), self.median_ms(FORWARD) + self.median_ms(RAW))

    def to_bound(self, name: str, start: str = FORWARD) -> Interval:
        return sweep_stats.to_bound(self.samples, name, self.iters, start)

    def to_cpu_floor(self, name: str) -> Interval:
        """Against ``max(no_comm + flat all-reduce CPU, to_first_gradient + flat all-reduce)`` (sweep_stats)."""
        return sweep_stats.to_bound(self.samples, name, self.iters, FIRST_GRADIENT, self.flat_cpu_s or 0.0)

    def to(self, name: str, reference: str) -> Interval:
        return sweep_stats.to_reference(self.samples, name, reference, self.iters)


def _ci(interval: Interval, digits: int = 2) -> str:
    ratio, low, high = interval
    return f"{ratio:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


# ---------------------------------------------------------------------- sections
def targets(results: list[ShapeResult]) -> list[str]:
    exact = {r.name: r.to_bound("gradsync")[0] for r in results}
    hook_ratios = {h: {r.name: r.to(h, NO_COMM)[0] for r in results} for h in GRADSYNC_HOOKS}
    found = [
        *sweep_stats.exact_targets(exact),
        sweep_stats.not_slower({r.name: r.to("gradsync", "torch_ddp") for r in results}),
        sweep_stats.hook_target(hook_ratios, _alone_median(results, "gradsync_powersgd_r1_alone")),
        *(
            sweep_stats.faster_than_torch(
                rank,
                {r.name: r.to(f"gradsync_powersgd_r{rank}", f"torch_powersgd_r{rank}") for r in results},
                {r.name for r in results if f"torch_powersgd_r{rank}" in r.nonfinite},
                {r.name for r in results if f"gradsync_powersgd_r{rank}" in r.nonfinite},
            )
            for rank in (1, 4)
        ),
    ]
    lines = ["| target | measured | result |", "|---|---|:---:|"]
    lines += [f"| {t.what} | {t.measured} | {'pass' if t.passed else '**fail**'} |" for t in found]
    if _has_controls(results):
        lines += [
            f"| A/A control: {t.what} | {t.measured} | {'would pass' if t.passed else 'would fail'} |"
            for t in _controls(results)
        ]
        for name, reference in (("gradsync", "torch_ddp"), ("gradsync_powersgd_r1", "torch_powersgd_r1")):
            again = CONTROLS[reference]
            lines.append(
                f"| pooled over every shape's rounds (geometric mean, 95%): {name} / {reference}; the A/A, "
                f"{again} / {reference} | {_ci(_pooled(results, name, reference), 3)}; "
                f"{_ci(_pooled(results, again, reference), 3)} | - |"
            )
    return lines


def _pooled(results: list[ShapeResult], name: str, reference: str) -> Interval:
    """``sweep_stats.pooled_ratio`` over the shapes where neither contender's weights went non-finite."""
    usable = [r for r in results if not {name, reference} & set(r.nonfinite)]
    return sweep_stats.pooled_ratio([(r.samples[name], r.samples[reference], r.iters) for r in usable])


def _has_controls(results: list[ShapeResult]) -> bool:
    return all(name in r.samples for r in results for name in CONTROLS.values())


def _controls(results: list[ShapeResult]) -> list[sweep_stats.Target]:
    """The per-shape tests with torch against its second instance ([Note: the A/A control] in sweep_stats.py)."""
    exact, hook = CONTROLS["torch_ddp"], CONTROLS["torch_powersgd_r1"]
    return sweep_stats.control_targets(
        {r.name: r.to(exact, "torch_ddp") for r in results},
        {r.name: r.to(hook, "torch_powersgd_r1") for r in results},
        {r.name for r in results if {"torch_powersgd_r1", hook} & set(r.nonfinite)},
    )


def _alone_median(results: list[ShapeResult], name: str) -> float | None:
    """The median over shapes of ``name`` / no_comm, or None for a report from before the CPU floors."""
    if not all(name in r.samples for r in results):
        return None
    return sweep_stats.distribution({r.name: r.to(name, NO_COMM)[0] for r in results}).median


def _mark(result: ShapeResult, name: str, cell: str) -> str:
    return f"{cell} (weights non-finite)" if name in result.nonfinite else cell


def distributions(results: list[ShapeResult]) -> list[str]:
    lines = [
        "| contender | / bound: median | p90 | worst (shape) | / no_comm: median | p90 | worst (shape) |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for name in (*EXACT, *HOOKS):
        b = sweep_stats.distribution({r.name: r.to_bound(name)[0] for r in results})
        f = sweep_stats.distribution({r.name: r.to(name, NO_COMM)[0] for r in results})
        lines.append(
            f"| {name} | {b.median:.3f} | {b.p90:.3f} | {b.worst:.3f} ({b.worst_shape}) "
            f"| {f.median:.3f} | {f.p90:.3f} | {f.worst:.3f} ({f.worst_shape}) |"
        )
    lines += ["", "Over the tight bound `max(no_comm, to_first_gradient + flat all-reduce)`:", ""]
    lines += ["| contender | median | p90 | worst (shape) |", "|---|---:|---:|---|"]
    for name in EXACT:
        t = sweep_stats.distribution({r.name: r.to_bound(name, FIRST_GRADIENT)[0] for r in results})
        lines.append(f"| {name} | {t.median:.3f} | {t.p90:.3f} | {t.worst:.3f} ({t.worst_shape}) |")
    if all(r.flat_cpu_s is not None for r in results):
        lines += [
            "",
            "Over the CPU floor `max(no_comm + the flat all-reduce's CPU time, to_first_gradient + flat all-reduce)`:",
        ]
        lines += ["", "| contender | median | p90 | worst (shape) |", "|---|---:|---:|---|"]
        for name in EXACT:
            c = sweep_stats.distribution({r.name: r.to_cpu_floor(name)[0] for r in results})
            lines.append(f"| {name} | {c.median:.3f} | {c.p90:.3f} | {c.worst:.3f} ({c.worst_shape}) |")
    if all(name in r.samples for r in results for name in ALONE):
        lines += [
            "",
            "CPU floors: the same setups over a group of one rank (no byte on a link, no wait), / no_comm:",
            "",
        ]
        lines += ["| setup | median | p90 | worst (shape) |", "|---|---:|---:|---|"]
        for name in ALONE:
            a = sweep_stats.distribution({r.name: r.to(name, NO_COMM)[0] for r in results})
            lines.append(f"| {name} | {a.median:.3f} | {a.p90:.3f} | {a.worst:.3f} ({a.worst_shape}) |")
    return lines


def shape_table(results: list[ShapeResult]) -> list[str]:
    lines = [
        "| shape | tensors | M params | grad MiB | no_comm ms | compute / byte ms/MiB | forward ms "
        "| flat all-reduce ms | flat all-reduce CPU ms | to first gradient ms | bound ms | gradsync buckets "
        "| gradsync comm ms | gradsync exposed comm ms | waited s | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        flat_cpu = "-" if r.flat_cpu_s is None else f"{r.flat_cpu_s * 1e3:.1f}"
        lines.append(
            f"| {r.name} | {r.tensors} | {r.params / 1e6:.2f} | {mib(r.nbytes)} | {r.median_ms(NO_COMM):.1f} "
            f"| {r.compute_per_byte():.2f} | {r.median_ms(FORWARD):.1f} | {r.median_ms(RAW):.1f} | {flat_cpu} "
            f"| {r.median_ms(FIRST_GRADIENT):.1f} | {r.bound_ms():.1f} | {r.buckets} | {r.comm_s * 1e3:.1f} "
            f"| {r.exposed_s * 1e3:.1f} | {r.waited_s:.0f} | {r.other_cores:.2f} |"
        )
    return lines


def exact_table(results: list[ShapeResult]) -> list[str]:
    lines = [
        "| shape | compute / byte | gradsync / bound | auto / bound | torch_ddp / bound | gradsync / torch_ddp "
        "| gradsync / tight bound | torch_ddp / tight bound | gradsync / CPU floor | gradsync_alone / no_comm "
        "| gradsync ms | torch_ddp ms | A/A: torch_ddp_again / torch_ddp |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    again = CONTROLS["torch_ddp"]
    for r in results:
        cells = " | ".join(_mark(r, name, _ci(r.to_bound(name))) for name in EXACT)
        alone = _ci(r.to("gradsync_alone", NO_COMM)) if "gradsync_alone" in r.samples else "-"
        cpu_floor = "-" if r.flat_cpu_s is None else _ci(r.to_cpu_floor("gradsync"))
        lines.append(
            f"| {r.name} | {r.compute_per_byte():.2f} | {cells} | {_ci(r.to('gradsync', 'torch_ddp'))} "
            f"| {_ci(r.to_bound('gradsync', FIRST_GRADIENT))} | {_ci(r.to_bound('torch_ddp', FIRST_GRADIENT))} "
            f"| {cpu_floor} | {alone} | {r.median_ms('gradsync'):.1f} | {r.median_ms('torch_ddp'):.1f} "
            f"| {_ci(r.to(again, 'torch_ddp')) if again in r.samples else '-'} |"
        )
    return lines


def hook_table(results: list[ShapeResult]) -> list[str]:
    lines = [
        "| shape | compute / byte | " + " | ".join(f"{h} / no_comm" for h in HOOKS) + " | gradsync / torch r=1 "
        "| gradsync / torch r=4 | gradsync_powersgd_r1_alone / no_comm | A/A: torch r=1 again / torch r=1 |",
        "|---|---:|" + "---:|" * (len(HOOKS) + 4),
    ]
    again = CONTROLS["torch_powersgd_r1"]
    for r in results:
        cells = " | ".join(_mark(r, h, _ci(r.to(h, NO_COMM))) for h in HOOKS)
        versus = " | ".join(_ci(r.to(f"gradsync_powersgd_r{k}", f"torch_powersgd_r{k}")) for k in (1, 4))
        alone = "gradsync_powersgd_r1_alone"
        floor = _ci(r.to(alone, NO_COMM)) if alone in r.samples else "-"
        control = _mark(r, again, _ci(r.to(again, "torch_powersgd_r1"))) if again in r.samples else "-"
        lines.append(f"| {r.name} | {r.compute_per_byte():.2f} | {cells} | {versus} | {floor} | {control} |")
    return lines


# ---------------------------------------------------------------------- chart
def write_chart(results: list[ShapeResult], path: Path, link_text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.compute_per_byte() for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for name, marker in zip(EXACT, "oDs"):
        left.scatter(x, [r.to_bound(name)[0] for r in results], marker=marker, label=name, alpha=0.8)
    for limit, style in ((1.05, ":"), (1.08, "--"), (1.12, "-.")):
        left.axhline(limit, color="grey", linestyle=style, linewidth=0.8)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("median step / bound max(no_comm, forward + flat all-reduce)")
    left.set_title("exact reducers (grey: targets 1.05 median, 1.08 p90, 1.12 worst)")
    for name, marker in zip(HOOKS, "o^sv*"):
        right.scatter(x, [r.to(name, NO_COMM)[0] for r in results], marker=marker, label=name, alpha=0.8)
    right.axhline(1.15, color="grey", linestyle=":", linewidth=0.8)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("median step / no communication")
    right.set_title("compressing hooks (grey: target 1.15 at the median)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("compute per byte: no-communication step ms per MiB of gradients (log)")
        ax.legend(fontsize=8)
    fig.suptitle(f"sweep over {len(results)} shapes, 2 ranks, gloo on CPU, {link_text} ({today()})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- the report
LOADED_CORES = 0.2  # other processes' CPU, in cores, above which a shape's numbers count as taken under load


def load_verdict(results: list[ShapeResult], load: MachineLoad) -> str:
    """Whether other processes shared the cores, from what was measured (never assumed either way)."""
    loaded = [r.name for r in results if r.other_cores >= LOADED_CORES]
    if not loaded and load.other_cores() < LOADED_CORES:
        worst = max((r.other_cores for r in results), default=0.0)
        return f"**Quiet run**: other processes used at most {worst:.2f} cores while any shape was measured."
    return (
        f"**Other processes shared the 2 cores during this run** ({len(loaded)} of {len(results)} shapes measured "
        f"while they used {LOADED_CORES} cores or more): those shapes' numbers were taken under load."
    )


def write(results: list[ShapeResult], load: MachineLoad, args: Any, command: str) -> Path:
    results = sorted(results, key=lambda r: r.compute_per_byte())
    kind = f"sweep-{args.label}" if args.label else "sweep"
    chart = report_path(kind, "png")
    link_text = (args.link or "plain loopback").replace("gbit", " Gbit/s")
    lines = [f"# Sweep: {len(results)} model shapes against the bound ({today()})", "", *environment_lines(command)]
    lines += [
        f"- machine load: {load.describe()}; at the report's writing {loadavg()}. {load_verdict(results, load)} "
        f"Before each shape the sweep waited up to {args.wait_for_quiet:.0f} s for other processes to use under "
        "0.3 cores; the shape table's last two columns say how long it waited and how many cores others then used "
        "while it measured",
        f"- per shape: {args.warmup} warm-up iterations per contender, then {args.rounds} rounds x {args.iters} "
        "iterations, contenders interleaved in an order drawn anew each round (seeded by the round, the same "
        "on every rank); time = slowest rank's",
        "- iteration = zero_grad(set_to_none=True), forward, loss, backward, SGD step (lr 1e-3, momentum 0.9)",
        "- ratios: median over rounds of each round's median ratio, [90% percentile-bootstrap interval over "
        "rounds]; to the bound: each round's `max(no_comm, forward_only + raw_allreduce)` "
        "([Note: the bound, per round] in lib/sweep_stats.py)",
        "- compute per byte: the no-communication step's median ms per MiB of fp32 gradients, measured here",
        "- distributions (median, p90 by linear interpolation, worst) are over the shapes' median ratios",
        "",
        "Contenders (no setting chosen per shape):",
        "",
        *[f"- `{name}`: {DESCRIPTIONS[name]}" for name in (*CONTENDERS, *ALONE)],
        f"- `{FORWARD}`, `{RAW}`, `{FIRST_GRADIENT}`: the suite's parts of the bound (benchmarks/README.md)",
        "",
        "## Targets (issue #46), on this run",
        "",
        *targets(results),
        "",
        "## Distribution over shapes",
        "",
        f"![ratio against compute per byte]({chart.name})",
        "",
        *distributions(results),
        "",
        "## Shapes (sorted by compute per byte)",
        "",
        *shape_table(results),
        "",
        "Descriptions: " + "; ".join(f"`{r.name}`: {r.description}" for r in results),
        "",
        "## Exact reducers per shape",
        "",
        *exact_table(results),
        "",
        "## Compressing hooks per shape",
        "",
        *hook_table(results),
        "",
    ]
    write_chart(results, chart, link_text)
    path = report_path(kind)
    path.write_text("\n".join(lines))
    # Every sample, so the tables can be recomputed (or shapes of two runs compared) without rerunning.
    raw = {
        r.name: {
            "nbytes": r.nbytes,
            "iters": r.iters,
            "other_cores": r.other_cores,
            "nonfinite": r.nonfinite,
            "flat_cpu_s": r.flat_cpu_s,
            "samples": r.samples,
        }
        for r in results
    }
    report_path(kind, "json").write_text(json.dumps(raw))
    return path
