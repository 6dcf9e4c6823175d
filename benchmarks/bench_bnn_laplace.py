"""The BNN classifier of the demo (breast cancer, 30-32-2, 169 held out): MAP, SVI and the
linearised Laplace approximation, on held-out mean log predictive density and ECE.

The demo's split, scaling and engines (SVI and MAP-Adam at 3000 steps, lr 0.01, seed 0);
Laplace around an L-BFGS MAP, full GGN or last layer, prior precision by the evidence (around
the model's MAP, or refitted: the classifier's default); NUTS on the same model (the model's
prior) as the exact posterior's reference; the MAP and NUTS again under the prior scale the
refit chose on each split. The
Laplace's log predictive density is its closed form (probit); every ECE reads
``classification_uncertainty`` (for Laplace the linearised network's draws). With
``--splits N`` each engine is also paired with the MAP over N random splits of the same sizes
(split 0 the demo's), which tells a gain from the demo split's noise.

    python benchmarks/bench_bnn_laplace.py --seeds 1 --splits 10 --json benchmarks/results/bnn-laplace.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.demo import _split  # noqa: E402
from aml_ppl.inference import MAP, NUTS, SVI, Laplace  # noqa: E402


def engines(steps: int) -> dict[str, object]:
    return {
        "SVI (demo)": SVI(num_steps=steps, lr=0.01, progress_bar=False),
        "MAP, Adam (demo)": MAP(optim="adam", num_steps=steps, lr=0.01, progress_bar=False),
        "Laplace, full GGN": Laplace(),
        "Laplace, full GGN, MC link": Laplace(link_approximation="mc"),
        "Laplace, last layer, evidence over it": Laplace(hessian="last_layer"),
        REFIT: Laplace(hessian="last_layer", prior_precision="refit"),
        "NUTS, 2 x (300 + 300), the exact posterior's reference": NUTS(num_samples=300, warmup_steps=300, num_chains=2),
    }


REFIT = "Laplace, last layer, prior scale by the refit (the classifier's default)"


def at_refit_scale(steps: int) -> dict[str, object]:
    r"""The engines refitted under the prior scale the refit chose on the same split: the MAP and
    the exact posterior of the empirical-Bayes model, which tell the refit's prior from its Gaussian."""
    return {
        "MAP, Adam, at the refit's prior scale": MAP(optim="adam", num_steps=steps, lr=0.01, progress_bar=False),
        "NUTS, 2 x (300 + 300), at the refit's prior scale": NUTS(num_samples=300, warmup_steps=300, num_chains=2),
    }


def load_breast_cancer_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    return torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.float32)


def scores(engine: object, X: torch.Tensor, labels: torch.Tensor, split: int, seed: int, prior_scale: float) -> dict:
    r"""One fit on ``split`` (400 training points; split 0 is the demo's), inputs standardised on
    the training points: per held-out point the log predictive density, then ECE, accuracy, seconds."""
    train, test = _split(len(X), len(X) - 400, seed=split)
    X = (X - X[train].mean(0)) / X[train].std(0)
    model = aml.models.BayesianNeuralNetwork(X.shape[1], hidden=(32,), out_features=2, likelihood="categorical", prior_scale=prior_scale)
    start = time.perf_counter()
    post = aml.fit(model, X[train], labels[train], engine=engine, seed=seed)
    seconds = time.perf_counter() - start
    density = post.log_prob(X[test], labels[test], num_samples=200)
    probs = aml.analysis.classification_uncertainty(post, X[test], num_samples=200).probs
    return {"density": density, "ece": float(aml.analysis.expected_calibration_error(probs, labels[test])),
            "accuracy": float(aml.analysis.accuracy(probs, labels[test])), "seconds": seconds,
            "factor": getattr(post, "prior_precision_factor", 1.0)}


def demo_split_rows(fits: dict, seeds: int, prior_scale: float) -> list[list]:
    r"""Each engine on the demo's split, its figures averaged over ``seeds``."""
    rows = []
    for name in dict.fromkeys(name for name, _, _ in fits):
        runs = [fits[name, 0, seed] for seed in range(seeds)]
        mean = [sum(column) / seeds for column in zip(*[(r["density"].mean().item(), r["ece"], r["accuracy"], r["seconds"]) for r in runs])]
        rows.append([name, prior_scale, round(mean[0], 4), round(mean[1], 4), round(mean[2], 4), round(mean[3], 1)])
    return rows


def paired_rows(fits: dict, splits: int, prior_scale: float) -> list[list]:
    r"""Each engine against the MAP over splits 0 to ``splits - 1`` (seed 0): the mean held-out
    log density, its difference from the MAP's paired by split (mean and standard error over the
    splits) and the splits where it is ahead, and the same for ECE (ahead: lower)."""
    reference = "MAP, Adam (demo)"
    rows = []
    for name in dict.fromkeys(name for name, _, _ in fits):
        density = torch.tensor([fits[name, split, 0]["density"].mean().item() for split in range(splits)])
        ece = torch.tensor([fits[name, split, 0]["ece"] for split in range(splits)])
        map_density = torch.tensor([fits[reference, split, 0]["density"].mean().item() for split in range(splits)])
        map_ece = torch.tensor([fits[reference, split, 0]["ece"] for split in range(splits)])
        gain, ece_gain = density - map_density, map_ece - ece
        paired = [f"{gain.mean():+.4f} ± {gain.std() / splits**0.5:.4f}", f"{int((gain > 0).sum())}/{splits}",
                  f"{-ece_gain.mean():+.4f} ± {ece_gain.std() / splits**0.5:.4f}", f"{int((ece_gain >= 0).sum())}/{splits}"]
        if name == reference:
            paired = ["the reference"] * 4
        rows.append([name, prior_scale, round(density.mean().item(), 4), *paired[:2], round(ece.mean().item(), 4), *paired[2:]])
    return rows


def breast_cancer(steps: int, seeds: int, splits: int, prior_scale: float, only: list[str]) -> tuple[list[list], list[list]]:
    r"""The demo split's rows (over ``seeds``) and, where ``splits`` > 1, the rows paired with the
    MAP over that many splits; ``only``: the engines whose names hold one of these words (all if empty)."""
    X, labels = load_breast_cancer_tensors()
    wanted = sorted({(0, seed) for seed in range(seeds)} | {(split, 0) for split in range(splits if splits > 1 else 0)})
    fits = {}
    for name, engine in [*engines(steps).items(), *at_refit_scale(steps).items()]:
        if only and not any(word in name for word in only):
            continue
        for split, seed in wanted:
            refit_scale = prior_scale / fits[REFIT, split, seed]["factor"] ** 0.5 if name in at_refit_scale(steps) else prior_scale
            fits[name, split, seed] = scores(engine, X, labels, split, seed, refit_scale)
            print(name, round(refit_scale, 3), split, seed, round(fits[name, split, seed]["density"].mean().item(), 4),
                  round(fits[name, split, seed]["ece"], 4), flush=True)
    return demo_split_rows(fits, seeds, prior_scale), paired_rows(fits, splits, prior_scale) if splits > 1 else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--splits", type=int, default=1, help="random 400/169 splits for the table paired with the MAP (1: none)")
    parser.add_argument("--prior-scales", type=float, nargs="+", default=[1.0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=[], help="run only the engines whose names hold one of these words")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    results = [breast_cancer(options.steps, options.seeds, options.splits, scale, options.only) for scale in options.prior_scales]
    rows = [row for demo, _ in results for row in demo]
    paired = [row for _, across in results for row in across]
    if options.json:
        record = {
            "title": "BNN classifier: MAP, SVI and the linearised Laplace approximation", "benchmark": "bench_bnn_laplace.py",
            "issues": [53], "command": f"python benchmarks/bench_bnn_laplace.py --steps {options.steps} --seeds {options.seeds} "
                       f"--splits {options.splits} --prior-scales {' '.join(map(str, options.prior_scales))}",
            "commit": os.popen("git rev-parse --short HEAD").read().strip(), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_line(), "load": f"load average {os.getloadavg()[0]:.1f}",
            "tables": [{"caption": f"Breast cancer, the demo's split (400 train, 169 held out), 30-32-2, mean over seeds 0-{options.seeds - 1}.",
                        "columns": ["engine", "prior_scale", "held-out log density", "ECE", "accuracy", "seconds"], "rows": rows}]
            + ([{"caption": f"Breast cancer over {options.splits} random splits (400 train, 169 held out; split 0 the demo's), seed 0: "
                            "each engine paired with the MAP by split (mean ± s.e. over the splits).",
                 "columns": ["engine", "prior_scale", "held-out log density", "minus the MAP's", "splits ahead of the MAP", "ECE",
                             "minus the MAP's ECE", "splits at or below the MAP's ECE"], "rows": paired}] if paired else []),
            "notes": "",
        }
        options.json.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
