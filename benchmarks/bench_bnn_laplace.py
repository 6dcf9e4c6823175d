"""The BNN classifier of the demo (breast cancer, 30-32-2, 169 held out): MAP, SVI and the
linearised Laplace approximation, on held-out mean log predictive density and ECE.

The demo's split, scaling and engines (SVI and MAP-Adam at 3000 steps, lr 0.01, seed 0);
Laplace around an L-BFGS MAP, full GGN or last layer, prior precision by the evidence; NUTS on
the same model (the model's prior) as the exact posterior's reference. The
Laplace's log predictive density is its closed form (probit); every ECE reads
``classification_uncertainty`` (for Laplace the linearised network's draws).

    python benchmarks/bench_bnn_laplace.py --json benchmarks/results/bnn-laplace.json
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
        "Laplace, last layer": Laplace(hessian="last_layer"),
        "NUTS, 2 x (300 + 300), the exact posterior's reference": NUTS(num_samples=300, warmup_steps=300, num_chains=2),
    }


def breast_cancer(steps: int, seeds: int, prior_scale: float) -> list[list]:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    X = torch.tensor(data.data, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.float32)
    train, test = _split(len(X), len(X) - 400)
    X = (X - X[train].mean(0)) / X[train].std(0)
    rows = []
    for name, engine in engines(steps).items():
        scores = []
        for seed in range(seeds):
            model = aml.models.BayesianNeuralNetwork(X.shape[1], hidden=(32,), out_features=2, likelihood="categorical", prior_scale=prior_scale)
            start = time.perf_counter()
            post = aml.fit(model, X[train], labels[train], engine=engine, seed=seed)
            seconds = time.perf_counter() - start
            density = post.log_prob(X[test], labels[test], num_samples=200).mean().item()
            probs = aml.analysis.classification_uncertainty(post, X[test], num_samples=200).probs
            scores.append((density, aml.analysis.expected_calibration_error(probs, labels[test]),
                           aml.analysis.accuracy(probs, labels[test]), seconds))
        mean = [sum(column) / len(column) for column in zip(*scores)]
        rows.append([name, prior_scale, round(mean[0], 4), round(mean[1], 4), round(mean[2], 4), round(mean[3], 1)])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prior-scales", type=float, nargs="+", default=[1.0])
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = [row for scale in options.prior_scales for row in breast_cancer(options.steps, options.seeds, scale)]
    if options.json:
        record = {
            "title": "BNN classifier: MAP, SVI and the linearised Laplace approximation", "benchmark": "bench_bnn_laplace.py",
            "issues": [53], "command": f"python benchmarks/bench_bnn_laplace.py --steps {options.steps} --seeds {options.seeds} "
                       f"--prior-scales {' '.join(map(str, options.prior_scales))}",
            "commit": os.popen("git rev-parse --short HEAD").read().strip(), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_line(), "load": f"load average {os.getloadavg()[0]:.1f}",
            "tables": [{"caption": f"Breast cancer, the demo's split (400 train, 169 held out), 30-32-2, mean over seeds 0-{options.seeds - 1}.",
                        "columns": ["engine", "prior_scale", "held-out log density", "ECE", "accuracy", "seconds"], "rows": rows}],
            "notes": "",
        }
        options.json.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
