"""PowerSGD's four products per stack of matrices: each form timed, and the one the hook uses against the best.

Run from the repository root (single process, about a minute):

    python -m benchmarks product_forms

which is exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.product_forms``.

``powersgd_hook`` runs four products on each stack of same-shaped matrices (``k x rows x cols``,
[Note: matrices stacked by shape] in ``src/gradsync/hooks/matrix_groups.py``): ``P = M Q``,
``Q = M^T P``, the error-feedback residual ``M -= P Q^T`` and the output ``P Q^T``, written into the
stack's view of the bucket, which is strided when something lies between two of the matrices (a bias). Each can be
issued in several forms of the same arithmetic (batched or a matrix at a time, plain or through
transposed operands, into the destination or through a temporary), and on CPU their costs differ
up to tenfold in ways that depend on the rank, the size and the CPU. ``src/gradsync/hooks/low_rank.py``
fixes one form per case ([Note: the forms of a stack's products]); with ``--timed-forms`` the study
reports instead what ``PowerSGDState(time_product_forms=True)`` runs for ``P = M Q``, ``Q = M^T P``
and the residual, the form timed fastest on this machine ([Note: forms chosen on the machine] in
``product_forms.py``). This study times every form
on one thread, checks each against a reference product first, and reports, per case, the
hook's own call (``project``, ``back_project``, ``subtract_product``, ``write_product``) against the
fastest other form. Writes ``benchmarks/results/YYYY-MM-DD-product-forms.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable

import torch

import gradsync
from benchmarks.lib import launch
from benchmarks.lib.common import processor, report_path, revision
from gradsync.hooks import low_rank
from gradsync.hooks.product_forms import FORMS, ProductForms

# (k, rows, cols): stacks as the grid's models give them (decoders of width 128-512, MLPs of many small
# layers, the conv net's 3 x 3 kernels read as rows x 9 * channels), small to large.
STACKS = [
    (16, 16, 16),
    (8, 32, 32),
    (400, 32, 32),
    (8, 10, 128),
    (8, 48, 48),
    (8, 64, 64),
    (4, 32, 288),
    (8, 128, 128),
    (3, 64, 576),
    (8, 384, 128),
    (8, 512, 128),
    (8, 128, 512),
    (3, 128, 1152),
    (2, 1024, 256),
    (1, 2048, 128),
]
RANKS = (1, 2, 4)
GAP = 64  # elements between two matrices of a strided output view (a bias)
REPEATS = 5
SLOWER = 1.10  # the hook's form counts as slower than the best other beyond this ratio
# The hook's forms for the rank-local products: the fixed defaults, or with --timed-forms the form timed on this
# machine at the second call of each case (during the warm-up calls: [Note: forms chosen on the machine] in
# src/gradsync/hooks/product_forms.py).
chooser = ProductForms(timed=False)
Form = Callable[[], None]


def timed(forms: dict[str, Form], order: random.Random) -> dict[str, float]:
    """Each form's best of ``REPEATS`` means over a batch of calls sized to ~10 ms, in microseconds.

    The forms take turns, in an order drawn anew for each repeat: on a shared machine a slow patch of
    a second or two (seen on an AVX2 machine when the forms were timed one after another: the hook's form
    and the identical form in the list 1.2-2x apart in one run) then costs every form one sample, not one
    form all of its samples."""
    batches = {}
    for name, fn in forms.items():
        for _ in range(3):
            fn()
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < 0.002:
            fn()
            calls += 1
        batches[name] = max(1, int(calls * 5))
    samples: dict[str, list[float]] = {name: [] for name in forms}
    names = list(forms)
    for _ in range(REPEATS):
        order.shuffle(names)
        for name in names:
            fn, batch = forms[name], batches[name]
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter() - start) / batch)
    return {name: min(samples[name]) * 1e6 for name in forms}


def one_by_one(op: Callable[..., None], *stacks: torch.Tensor) -> Form:
    def run() -> None:
        for parts in zip(*(s.split(1) for s in stacks)):
            op(*parts)

    return run


def t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def four_ways(
    mine: Form, plain: tuple[str, Product], transposed: tuple[str, Product], *stacks: torch.Tensor
) -> dict[str, Form]:
    """The hook's call, and a product written plainly and through transposed operands, each batched and one by one."""
    forms = {"gradsync": mine}
    for name, product in (plain, transposed):
        forms[f"{name} batched"] = lambda product=product: product(*stacks)
    for name, product in (plain, transposed):
        forms[f"{name} one by one"] = one_by_one(product, *stacks)
    return forms


# The plain and transposed forms are the hook's own (src/gradsync/hooks/product_forms.py's FORMS; the transposed
# products are low_rank.py's defaults), so that what is timed here is what the hook would run.
def projection_forms(m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> dict[str, Form]:
    plain, transposed = FORMS["project"]["M Q"], low_rank.project
    return four_ways(lambda: chooser.project(m, q, p), ("M Q", plain), ("(Q^T M^T)^T", transposed), m, q, p)


def back_projection_forms(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> dict[str, Form]:
    plain, transposed = FORMS["back_project"]["M^T P"], low_rank.back_project
    return four_ways(lambda: chooser.back_project(m, p, q), ("M^T P", plain), ("(P^T M)^T", transposed), m, p, q)


def residual_forms(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> dict[str, Form]:
    plain, transposed = FORMS["subtract_product"]["M -= P Q^T"], FORMS["subtract_product"]["M^T -= Q P^T"]
    return {
        "gradsync": lambda: chooser.subtract_product(m, p, q),
        "M -= P Q^T batched": lambda: plain(m, p, q),
        "M^T -= Q P^T batched": lambda: transposed(m, p, q),
        "M -= P Q^T one by one": one_by_one(plain, m, p, q),
    }


def output_forms(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> dict[str, Form]:
    def into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        torch.matmul(p, t(q), out=out)

    return {
        "gradsync": lambda: low_rank.write_product(out, p, q),
        "P Q^T into the view": lambda: into(out, p, q),
        "P Q^T, then copied": lambda: out.copy_(torch.matmul(p, t(q))),
        "(Q P^T)^T into the view": lambda: torch.matmul(q, t(p), out=t(out)),
        "P Q^T into the view one by one": one_by_one(into, out, p, q),
    }


def check(forms: dict[str, Form], result: torch.Tensor, reset: Callable[[], None], expected: torch.Tensor) -> None:
    """Every form computes the same product (else its time would mean nothing)."""
    for name, form in forms.items():
        reset()
        form()
        if not torch.allclose(result, expected, rtol=1e-4, atol=1e-4):
            raise AssertionError(f"form {name!r} computes something else: max error {(result - expected).abs().max()}")


def cases(k: int, rows: int, cols: int, r: int) -> list[tuple[str, dict[str, Form]]]:
    """Each product's forms for this stack and rank, each checked against a reference product."""
    generator = torch.Generator().manual_seed(0)
    m0 = torch.randn(k, rows, cols, generator=generator)
    q = torch.randn(k, cols, r, generator=generator)
    p = torch.randn(k, rows, r, generator=generator)
    outer = torch.matmul(p, t(q))
    p_out = torch.empty(k, rows, r)
    projections = projection_forms(m0, q, p_out)
    check(projections, p_out, lambda: p_out.zero_(), torch.matmul(m0, q))
    q_out = torch.empty(k, cols, r)
    back_projections = back_projection_forms(m0, p, q_out)
    check(back_projections, q_out, lambda: q_out.zero_(), torch.matmul(t(m0), p))
    m = m0.clone()
    residuals = residual_forms(m, p, q)
    check(residuals, m, lambda: m.copy_(m0), m0 - outer)
    found = [("P = M Q", projections), ("Q = M^T P", back_projections), ("M -= P Q^T", residuals)]
    for layout, gap in (("contiguous", 0), ("strided", GAP)):
        storage = torch.empty(k * (rows * cols + gap))
        out = storage.as_strided((k, rows, cols), (rows * cols + gap, cols, 1))
        outputs = output_forms(out, p, q)
        check(outputs, out, lambda: out.zero_(), outer)  # noqa: B023 - checked before the next layout
        found.append((f"output, {layout}", outputs))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", help="appended to the report's name: product-forms-LABEL.md")
    parser.add_argument(
        "--timed-forms",
        action="store_true",
        help="the hook with PowerSGDState(time_product_forms=True): each rank-local product timed on this machine",
    )
    args = parser.parse_args()
    chooser.timed = args.timed_forms
    torch.set_num_threads(1)
    order = random.Random(0)
    rows_out: list[str] = []
    slower: list[str] = []
    for k, rows, cols in STACKS:
        for r in RANKS:
            for product, forms in cases(k, rows, cols, r):
                times = timed(forms, order)
                mine = times.pop("gradsync")
                best = min(times, key=times.__getitem__)
                ratio = mine / times[best]
                case = f"{k} x ({rows} x {cols}), r={r}, {product}"
                others = ", ".join(f"{name} {us:.1f}" for name, us in times.items())
                rows_out.append(f"| {case} | {mine:.1f} | {best} {times[best]:.1f} | {ratio:.2f} | {others} |")
                print(rows_out[-1], flush=True)
                if ratio > SLOWER:
                    slower.append(f"{case} ({ratio:.2f})")
    total = len(rows_out)
    lines = [
        f"# PowerSGD's products: the form the hook uses against every other ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {revision()}), {os.cpu_count()} CPU cores ({processor()}), 1 torch thread, fp32",
        f"- microseconds per call, best of {REPEATS} means over ~10 ms of calls, the forms of a case taking turns "
        "in an order drawn anew each time; every form checked against a "
        f"reference product first; a strided output has {GAP} elements between two matrices; "
        "[Note: the forms of a stack's products] in src/gradsync/hooks/low_rank.py",
        "- the hook's forms: "
        + (
            "timed on this machine (`--timed-forms`: `PowerSGDState(time_product_forms=True)`, [Note: forms chosen "
            "on the machine] in src/gradsync/hooks/product_forms.py)"
            if args.timed_forms
            else "the fixed ones (the default)"
        ),
        f"- the hook's form slower than the best other by more than {SLOWER:.2f}x: {len(slower)} of {total} cases"
        + (f": {'; '.join(slower)}" if slower else ""),
        "",
        "| stack, rank, product | gradsync us | best other form us | gradsync / best | every other form us |",
        "|---|---:|---|---:|---|",
        *rows_out,
    ]
    path = report_path("product-forms" + (f"-{args.label}" if args.label else ""))
    path.write_text("\n".join(lines) + "\n")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
