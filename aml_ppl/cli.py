r"""The ``aml-ppl`` command: fit a built-in model to a CSV file and summarise the posterior.

Example::

    aml-ppl fit data.csv --target y --model blr --engine nuts --save post.pt
    aml-ppl fit points.csv --model gmm --components 3
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from aml_ppl import __version__
from aml_ppl.api import fit
from aml_ppl.analysis.diagnostics import summary
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.models import BayesianLinearRegression, GaussianMixture, GaussianProcess


def read_csv(path: Path, target: str | None) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    r"""Numeric columns of a CSV file with a header: ``(X, y, feature names)``."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if len(rows) < 2:
        raise InputDataError(f"{path} needs a header row and at least one data row.")
    header, body = rows[0], rows[1:]
    try:
        values = torch.tensor([[float(cell) for cell in row] for row in body], dtype=torch.float64)
    except ValueError as error:
        raise InputDataError(f"{path} has a non-numeric cell: {error}.") from error
    if target is None:
        return values, None, header
    if target not in header:
        raise InputDataError(f"`--target` {target!r} is not a column of {path}; columns: {header}.")
    column = header.index(target)
    features = [name for name in header if name != target]
    keep = [index for index in range(len(header)) if index != column]
    return values[:, keep], values[:, column], features


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aml-ppl", description="Fit aml_ppl models from the command line.")
    parser.add_argument("--version", action="version", version=f"aml_ppl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    fitting = commands.add_parser("fit", help="fit a model to a CSV file and print an ArviZ summary")
    fitting.add_argument("csv", type=Path)
    fitting.add_argument("--model", choices=("blr", "gp", "gmm"), default="blr")
    fitting.add_argument("--target", help="the response column (blr, gp)")
    fitting.add_argument("--engine", default=None, help="svi, map, nuts, exact or em (default: the model's)")
    fitting.add_argument("--components", type=int, default=2, help="mixture components (gmm)")
    fitting.add_argument("--intercept", action="store_true", help="append a column of ones (blr)")
    fitting.add_argument("--seed", type=int, default=0)
    fitting.add_argument("--save", type=Path, help="write the posterior here")
    options = parser.parse_args(argv)
    try:
        X, y, names = read_csv(options.csv, options.target if options.model != "gmm" else None)
        if options.model != "gmm" and y is None:
            raise InputDataError(f"--model {options.model} needs `--target`.")
        if options.model == "blr":
            if options.intercept:
                X, names = torch.cat([X, torch.ones_like(X[:, :1])], dim=1), names + ["intercept"]
            model, args = BayesianLinearRegression(noise_scale=None), (X, y)
        elif options.model == "gp":
            model, args = GaussianProcess(standardize_outputs=True), (X, y)
        else:
            model, args = GaussianMixture(options.components), (X,)
        posterior = fit(model, *args, engine=options.engine, seed=options.seed)
        print(f"{options.model} by {posterior.engine} on {X.shape[0]} rows; features: {', '.join(names)}")
        print(summary(posterior).to_string())
        if options.save is not None:
            posterior.save(options.save)
            print(f"saved the posterior to {options.save}")
    except AmlPplError as error:
        print(f"aml-ppl: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
