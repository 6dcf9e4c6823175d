"""The gallery: run the fast examples in examples/ and draw a figure from what each computed.

Usage: ``python docs/gallery.py [--full]`` (from the repository root). Each example runs as
``python examples/NAME.py --smoke`` would (``--full``: with its full budgets, minutes), in this
process, and the figure is drawn from the objects the script left; the PNGs go to
docs/gallery/, which docs/gallery.md shows. The MkDocs hook (docs/hooks.py) runs this when a
figure is missing, so the figures always come from the code as it is.
"""

import os
import runpy
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
OUT = Path(__file__).parent / "gallery"


def run_example(name: str, full: bool) -> dict:
    """Run examples/``name``.py as a script (``--smoke`` unless ``full``) and return its globals."""
    argv = sys.argv
    sys.argv = [f"{name}.py"] + ([] if full else ["--smoke"])
    sys.path.insert(0, str(EXAMPLES))
    try:
        return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    finally:
        sys.argv = argv
        sys.path.remove(str(EXAMPLES))


def draw_mixture(ns: dict, ax) -> None:
    X, best = ns["X"], ns["best"]
    labels = best.responsibilities(X).argmax(-1)
    ax.scatter(X[:, 0], X[:, 1], c=labels, s=6, cmap="viridis")
    ax.scatter(*best.params["means"].T, marker="x", s=120, c="red", label="component means")
    ax.set_title(f"EM, k = {best.params['weights'].numel()} chosen by BIC")
    ax.legend()


def draw_bnn(ns: dict, ax) -> None:
    grid = torch.linspace(-5, 5, 200)[:, None]
    split = ns["aml"].analysis.regression_uncertainty(ns["posterior"], grid)
    mean, sd = split.mean.squeeze(), split.total.sqrt().squeeze()
    ax.fill_between(grid[:, 0], mean - 2 * sd, mean + 2 * sd, alpha=0.3, label="±2 sd (total)")
    ax.plot(grid[:, 0], mean, label="predictive mean")
    ax.scatter(ns["x"][:, 0], ns["y"], s=3, c="k", label="data")
    ax.set_title("BNN: the band widens where there are no data")
    ax.legend()


def draw_ddpm(ns: dict, ax) -> None:
    test, samples = ns["test"], ns["samples"]
    ax.scatter(test[:, 0], test[:, 1], s=3, alpha=0.5, label="held-out data")
    ax.scatter(samples[:, 0], samples[:, 1], s=3, alpha=0.5, label="DDPM samples")
    ax.set_title("DDPM on two moons: ancestral samples")
    ax.legend()


def draw_safe_bo(ns: dict, ax) -> None:
    domain, records = ns["domain"], [r for r in ns["resumed"].records if r.values]
    ax.scatter(domain[:, 0], domain[:, 1], s=2, c="0.8", label="candidates")
    points = torch.stack([torch.as_tensor(r.x) for r in records])
    ax.scatter(points[:, 0], points[:, 1], c=range(len(points)), cmap="plasma", s=20, label="evaluations")
    ax.add_patch(plt.Circle((0.3, 0.3), 0.6, fill=False, ls="--", label="safe disc"))
    ax.set_aspect("equal")
    ax.set_title("Safe BO on a problem of your own")
    ax.legend(loc="lower right")


FIGURES = {"mixture": draw_mixture, "bnn": draw_bnn, "ddpm": draw_ddpm, "safe_bo_own_problem": draw_safe_bo}


def missing_figures() -> list[str]:
    """The gallery's figures not yet drawn."""
    return [name for name in FIGURES if not (OUT / f"{name}.png").exists()]


def main(argv: list[str]) -> None:
    OUT.mkdir(exist_ok=True)
    for name, draw in FIGURES.items():
        namespace = run_example(name, full="--full" in argv)
        figure, ax = plt.subplots(figsize=(6, 4.5))
        draw(namespace, ax)
        figure.tight_layout()
        partial = OUT / f".{name}.{os.getpid()}.png"  # written whole, then renamed: builds in parallel
        figure.savefig(partial, dpi=100)               # never read half a figure
        os.replace(partial, OUT / f"{name}.png")
        plt.close("all")
        print(f"gallery: {OUT / name}.png")


if __name__ == "__main__":
    main(sys.argv[1:])
