"""Which library should multiply here: toolkit.kernels.onednn's products under each choice, timed side by side.

    python benchmarks/products.py [--rows 5248] [--repeats 40] [--threads 1]

`toolkit.kernels.onednn.products_by()` picks MKL's GEMM where MKL runs AVX-512 kernels (an Intel CPU with AVX-512)
and oneDNN's inner product elsewhere, from the CPU alone. This prints both, at HRM cpu-small's shapes (64 puzzles x
82 positions = 5,248 rows; hidden 64, SwiGLU 2 x 256, qkv 192) for the forward products and the weight gradients
as the step calls them (`product`, `weight_gradient`; SwiGLU's gate_up gradient with g's transpose at hand, as the
transposed Function holds it), each library forced in turn: the first quartile of --repeats calls, in ms. The last
lines say the CPU, the choice made here and the sum of each column.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the toolkit, when not installed


def first_quartile_ms(call, repeats: int) -> float:
    call()  # first-call allocations
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return sorted(times)[repeats // 4] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=5248, help="rows of each product (batch x positions)")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls of each product and library")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    for name in ("rows", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} is invalid; give an integer >= 1")

    import torch

    from toolkit.kernels import onednn
    from toolkit.run.precision import cpu_kind

    if not onednn.available():
        sys.exit("error: this torch has no oneDNN inner product (mkldnn._linear_pointwise); nothing to compare")
    torch.set_num_threads(args.threads)
    chosen, rows = onednn.products_by(), args.rows
    cases = []  # (label, call)
    for inputs, outputs, label in [
        (64, 256, "gate or up (no gradient)"),
        (256, 64, "SwiGLU down"),
        (64, 192, "qkv"),
        (64, 64, "attention out"),
    ]:
        x, weight = torch.randn(rows, inputs), torch.randn(outputs, inputs)
        cases.append(
            (
                f"forward {label}: [{rows}, {inputs}] by [{outputs}, {inputs}].T",
                lambda x=x, weight=weight: onednn.product(x, weight),
            )
        )
    x, weight = torch.randn(rows, 64), torch.randn(512, 64)
    cases.append(
        (f"forward SwiGLU gate_up, transposed: [512, 64] by [{rows}, 64].T", lambda: onednn.product(weight, x))
    )
    for inputs, outputs, transposed in [(64, 512, True), (256, 64, False), (64, 192, False), (64, 64, False)]:
        x, g = torch.randn(rows, inputs), torch.randn(rows, outputs)
        g, at_hand = (g.t().contiguous().t(), ", g.T at hand") if transposed else (g, "")
        cases.append(
            (
                f"weight gradient: x [{rows}, {inputs}], g [{rows}, {outputs}]{at_hand}",
                lambda x=x, g=g: onednn.weight_gradient(x, g),
            )
        )
    libraries = ("onednn", "mkl")
    totals = dict.fromkeys(libraries, 0.0)
    print(f"| product | {' | '.join(libraries)} |\n| --- | ---: | ---: |")
    for label, call in cases:
        times = {}
        for library in libraries:
            onednn.products_by = lambda library=library: library  # forced for this measurement alone
            times[library] = first_quartile_ms(call, args.repeats)
            totals[library] += times[library]
        print(f"| {label} | {' | '.join(f'{times[library]:.2f}' for library in libraries)} |", flush=True)
    print(f"CPU: {cpu_kind(threads=args.threads)}")
    print(f"products_by() here: {chosen}")
    print(
        "sum: "
        + ", ".join(f"{library} {totals[library]:.2f} ms" for library in libraries)
        + f"; onednn/mkl = {totals['onednn'] / totals['mkl']:.2f}"
    )


if __name__ == "__main__":
    main()
