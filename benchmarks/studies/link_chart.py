"""Step time against link rate, per contender, with the exact-reducer bound drawn.

Run from the repository root (single process, a few seconds):

    python -m benchmarks link_chart --workload transformer --out benchmarks/results/DATE-link-transformer.png \\
        benchmarks/results/DATE-suite-1gbit.md benchmarks/results/DATE-suite-10gbit.md \\
        benchmarks/results/DATE-suite.md

which is exactly ``python -m benchmarks.studies.link_chart ...``. Reads suite reports (the ``suite``
study, one per link: ``--link 1gbit``, ``--link 10gbit``, plain loopback) and plots each
contender's median iteration time on the workload against the link's rate, with the bound
``max(no_comm, forward + flat all-reduce)`` of each report's "Distance to the limit" table.
Plain loopback is drawn at the right end, labelled "loopback".
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

SHOWN = ("gradsync", "gradsync_best", "torch_ddp", "torch_ddp_view", "one_allreduce", "no_comm")


def _rows(text: str, header_start: str) -> list[list[str]]:
    """The rows of the first markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip("|").split("|")])
            return rows
    return []


def read_report(path: Path, workload: str) -> tuple[str, dict[str, float], float | None]:
    """(link label, median ms per contender, bound ms or None) of ``workload`` in one suite report."""
    text = path.read_text()
    match = re.search(r"link: loopback shaped to (\S+)", text)
    label = match.group(1) if match else "loopback"
    medians = {}
    for cells in _rows(text, "| workload | contender | median ms"):
        if cells[0] == workload:
            medians[cells[1].split(" ")[0]] = float(cells[2])
    bound = None
    for cells in _rows(text, "| workload | bound ms"):
        if cells[0] == workload:
            bound = float(cells[1])
    return label, medians, bound


def _gbit(label: str) -> float:
    value = float(re.match(r"[\d.]+", label).group(0))
    return value / 1000 if label.endswith("mbit") else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [read_report(path, args.workload) for path in args.reports]
    shaped = sorted((p for p in points if p[0] != "loopback"), key=lambda p: _gbit(p[0]))
    ordered = shaped + [p for p in points if p[0] == "loopback"]
    xs = list(range(len(ordered)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SHOWN:
        ys = [p[1].get(name) for p in ordered]
        if any(y is not None for y in ys):
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=name)
    bounds = [p[2] if p[2] is not None else float("nan") for p in ordered]
    ax.plot(xs, bounds, "k--", linewidth=2, label="bound: max(no_comm, forward + flat all-reduce)")
    ax.set_xticks(xs, [p[0] for p in ordered])
    ax.set_xlabel("link (2 ranks, gloo)")
    ax.set_ylabel("median iteration time, ms")
    ax.set_yscale("log")
    ax.set_title(f"{args.workload}: step time against link rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"chart: {args.out}")


if __name__ == "__main__":
    main()
