r"""The ``aml-ppl`` command (also ``python -m aml_ppl``): fit a built-in model to a table.

Example::

    aml-ppl demo --quick                     # every model family, an HTML report
    aml-ppl fit blr data.csv --target y --engine nuts --num-samples 500 --out fits/blr
    aml-ppl fit gmm points.parquet --components 3 --out fits/gmm

``fit`` reads a CSV or Parquet file (pandas), prints the ArviZ summary and writes into
``--out`` the InferenceData as NetCDF (``inference_data.nc``), the saved posterior
(``posterior.pt``, for :func:`aml_ppl.load`) and a predictive figure (``predictive.png``).
Every error a person can act on (a missing file, an unknown column, a missing value, an
engine the model does not run) is one line on stderr with exit code 2, and nothing is
written; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from aml_ppl import __version__
from aml_ppl._core.files import atomic_path
from aml_ppl.api import default_engine_options, fit
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference import EM, MAP, NUTS, SVI, ChEES, Exact, Laplace

MODELS = ("blr", "logistic", "gp", "gmm", "bnn")
# Engine options of the command line: flag to (engine classes that take it, keyword).
ENGINE_OPTIONS = {
    "num_samples": ((NUTS, ChEES), "num_samples"),
    "warmup_steps": ((NUTS, ChEES), "warmup_steps"),
    "num_chains": ((NUTS, ChEES), "num_chains"),
    "num_steps": ((SVI, MAP, Laplace), "num_steps"),
    "n_init": ((EM,), "n_init"),
}
DEFAULT_MIXTURE_STARTS = 5


def read_table(path: Path) -> Any:
    r"""A pandas ``DataFrame`` from a CSV or Parquet (``.parquet``, ``.pq``) file with unique
    column names and at least two data rows, or an error naming the file and the problem."""
    import pandas as pd

    if not path.exists():
        raise InputDataError(f"{path}: no such file.")
    if path.is_dir():
        raise InputDataError(f"{path} is a directory; give a CSV or Parquet file.")
    if not os.access(path, os.R_OK):
        raise InputDataError(f"{path} is not readable (permissions).")
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            frame = pd.read_parquet(path)
        except ImportError as error:
            raise InputDataError(f"reading Parquet needs pyarrow: pip install pyarrow ({error}).") from error
    else:
        frame = _read_csv(path)
    if len(frame) < 2:
        raise InputDataError(f"{path} has {len(frame)} data row(s) under its header; fitting needs at least 2.")
    return frame


def _read_csv(path: Path) -> Any:
    import pandas as pd

    with open(path, newline="", encoding="utf-8", errors="replace") as file:
        header = [name.strip() for name in next(csv.reader(file), [])]
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise InputDataError(f"{path}: column name(s) {repeated} appear more than once in the header; name each column once.")
    try:
        return pd.read_csv(path, skipinitialspace=True)
    except pd.errors.EmptyDataError as error:
        raise InputDataError(f"{path} is empty; it needs a header row and data rows.") from error
    except pd.errors.ParserError as error:
        found = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(error))
        if found:
            expected, line, saw = found.groups()
            raise InputDataError(f"{path}: line {line} has {saw} fields where the header has {expected} (a ragged row).") from error
        raise InputDataError(f"{path} is not a readable CSV file: {error}") from error


def numeric_columns(frame: Any, columns: list[str], path: Path, dropna: bool) -> Any:
    r"""``frame[columns]`` as float64, naming the row and column of any non-numeric or
    missing value (rows count data rows from 1; line = row + 1 in a CSV with its header)."""
    import pandas as pd

    chosen = frame[columns]
    for column in columns:
        values = pd.to_numeric(chosen[column], errors="coerce")
        bad = values.isna() & chosen[column].notna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise InputDataError(
                f"{path}: non-numeric value {chosen[column].iloc[row]!r} in column {column!r}, data row {row + 1} "
                f"(line {row + 2}); {int(bad.sum())} such value(s) in that column."
            )
    chosen = chosen.apply(pd.to_numeric).astype("float64")
    missing = chosen.isna()
    if missing.to_numpy().any() and not dropna:
        column = missing.any().idxmax()
        rows = (missing[column].to_numpy().nonzero()[0] + 1).tolist()
        listed = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise InputDataError(
            f"{path}: {int(missing.to_numpy().sum())} missing value(s); column {column!r} at data row(s) {listed}. "
            "Fill them, or pass --dropna to drop those rows."
        )
    return chosen.dropna()


def chosen_columns(frame: Any, options: argparse.Namespace) -> tuple[list[str], str | None]:
    r"""``(feature columns, target column)`` from ``--target``, ``--features`` and ``--drop``."""
    columns = [str(name) for name in frame.columns]
    named = ([options.target] if options.target else []) + (options.features or []) + (options.drop or [])
    unknown = [name for name in named if name not in columns]
    if unknown:
        raise InputDataError(f"unknown column(s) {unknown}; the file has {columns}.")
    if options.model == "gmm" and options.target:
        raise InputDataError("gmm takes no --target: a mixture models every chosen column.")
    if options.model != "gmm" and not options.target:
        raise InputDataError(f"{options.model} needs --target COLUMN (the response).")
    features = options.features or [name for name in columns if name != options.target and name not in (options.drop or [])]
    if options.target in features:
        raise InputDataError(f"--target {options.target!r} is also a feature; leave it out of --features.")
    if not features:
        raise InputDataError("no feature columns are left to fit on.")
    return features, options.target


def build_model(options: argparse.Namespace, X: torch.Tensor, y: torch.Tensor | None) -> tuple[Any, tuple]:
    r"""The built-in model named on the command line, and its arguments."""
    from aml_ppl import models

    if options.model == "blr":
        design = X if options.no_intercept else torch.cat([X, torch.ones_like(X[:, :1])], dim=1)
        return models.BayesianLinearRegression.scaled_to(design, y), (design, y)
    if options.model == "logistic":
        classes = int(y.max().item()) + 1 if y.numel() else 2
        if options.no_intercept:
            return models.BayesianLogisticRegression(num_classes=max(classes, 2)), (X, y)
        return models.BayesianLogisticRegression.scaled_to(X, num_classes=max(classes, 2)), (X, y)
    if options.model == "gp":
        return models.GaussianProcess(), (X, y)
    if options.model == "bnn":
        return models.BayesianNeuralNetwork(X.shape[1], hidden=(50,)), (X, y)
    return models.GaussianMixture(options.components), (X,)


def build_engine(options: argparse.Namespace, model: Any) -> Any:
    r"""The engine by name (the model's default without ``--engine``) with the options given;
    an option the engine does not take is an error, not silently dropped."""
    from aml_ppl.inference.base import ENGINES

    name = options.engine or model.default_engine
    if name not in ENGINES:
        raise InputDataError(f"unknown --engine {name!r}; choose from {sorted(ENGINES)}.")
    engine_class = ENGINES[name]
    settings: dict[str, Any] = {"progress_bar": False} if engine_class not in (Exact, ChEES) else {}
    settings.update(default_engine_options(model, name))
    for flag, (classes, keyword) in ENGINE_OPTIONS.items():
        value = getattr(options, flag)
        if value is None:
            continue
        if engine_class not in classes:
            takers = ", ".join(cls.name for cls in classes)
            raise InputDataError(f"--{flag.replace('_', '-')} is an option of {takers}; the engine is {name}.")
        settings[keyword] = value
    if engine_class is EM and options.model == "gmm":
        settings.setdefault("n_init", DEFAULT_MIXTURE_STARTS)
    return engine_class(**settings)


def check_output_folder(folder: Path) -> None:
    r"""Refuse, before any fitting, an output folder that cannot be written (nothing is created)."""
    if folder.exists():
        if not folder.is_dir():
            raise InputDataError(f"--out {folder} is a file; give a folder.")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputDataError(f"--out {folder} is not writable.")
        return
    parent = next(parent for parent in folder.absolute().parents if parent.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputDataError(f"--out {folder} cannot be created: {parent} is not a writable folder.")


def predictive_figure(options: argparse.Namespace, posterior: Any, args: tuple) -> Any:
    r"""Observed against predicted (mean and 95 % interval) for regressions, a reliability
    diagram for logistic regression, the points coloured by component for a mixture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aml_ppl.analysis import plot_reliability_diagram

    figure, axes = plt.subplots(figsize=(5, 4.5))
    if options.model == "gmm":
        X = args[0]
        labels = posterior.predict_labels(X)
        axes.scatter(X[:, 0], X[:, 1] if X.shape[1] > 1 else torch.zeros(len(X)), c=labels, s=8, cmap="tab10")
        axes.set_title(f"mixture components ({options.components})")
    elif options.model == "logistic":
        probs = posterior.predict(args[0], site="probs", num_samples=200).mean
        probs = torch.stack([1 - probs, probs], -1) if probs.dim() == 1 else probs
        plot_reliability_diagram(probs, args[1], ax=axes)
    else:
        prediction = posterior.predict(*args[:1], num_samples=200)
        low, high = prediction.interval(0.95)
        axes.errorbar(args[1], prediction.mean, yerr=torch.stack([prediction.mean - low, high - prediction.mean]), fmt=".", alpha=0.5)
        bounds = [float(args[1].min()), float(args[1].max())]
        axes.plot(bounds, bounds, "k--", linewidth=1)
        axes.set_xlabel("observed")
        axes.set_ylabel("predicted mean and 95 % interval")
    figure.tight_layout()
    return figure


def fit_command(options: argparse.Namespace) -> None:
    from aml_ppl.analysis.diagnostics import summary

    frame = read_table(options.data)
    features, target = chosen_columns(frame, options)
    check_output_folder(options.out)
    table = numeric_columns(frame, features + ([target] if target else []), options.data, options.dropna)
    if len(table) < len(frame):
        print(f"dropped {len(frame) - len(table)} row(s) with missing values (--dropna)")
    X = torch.tensor(table[features].to_numpy(), dtype=torch.float64)
    y = torch.tensor(table[target].to_numpy(), dtype=torch.float64) if target else None
    model, args = build_model(options, X, y)
    engine = build_engine(options, model)
    posterior = fit(model, *args, engine=engine, seed=options.seed)
    idata = posterior.to_arviz()
    figure = predictive_figure(options, posterior, args)
    print(f"{options.model} by {posterior.engine} on {X.shape[0]} rows; features: {', '.join(features)}")
    if options.model == "blr":
        print("prior scaled to the data (rstanarm's): slopes N(0, (2.5 sd(y) / sd(x))^2), the line at the "
              "features' means N(mean(y), (2.5 sd(y))^2), noise learned")
    if options.model == "logistic" and not options.no_intercept:
        print("prior scaled to the features (rstanarm's): weights N(0, (2.5 / sd(x))^2), the logit at the "
              "features' means N(0, 2.5^2)")
    print(summary(posterior).to_string())
    options.out.mkdir(parents=True, exist_ok=True)
    posterior.save(options.out / "posterior.pt")
    with atomic_path(options.out / "inference_data.nc") as temporary:
        idata.to_netcdf(str(temporary))
    with atomic_path(options.out / "predictive.png") as temporary:
        figure.savefig(temporary, dpi=100)
    print(f"wrote {options.out / 'inference_data.nc'}, {options.out / 'posterior.pt'} and {options.out / 'predictive.png'}")


def demo_command(options: argparse.Namespace) -> None:
    from aml_ppl.demo import run_demo

    check_output_folder(options.out)
    report = run_demo(options.out, quick=options.quick, device=options.device)
    print(f"\nreport: {report}\nfigures: {report.parent}")


def parser() -> argparse.ArgumentParser:
    command = argparse.ArgumentParser(prog="aml-ppl", description="Fit aml_ppl models from the command line.")
    command.add_argument("--version", action="version", version=f"aml_ppl {__version__}")
    commands = command.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="fit every model family and write an HTML report",
        description="Fit every model family with its default engine and one alternative, run a safe-BO loop, "
        "and write a self-contained HTML report with its figures into a new run folder under --out.",
    )
    demo.add_argument("--quick", action="store_true", help="a smoke run with tiny budgets (under a minute)")
    demo.add_argument("--out", type=Path, default=Path("aml-ppl-demo"), help="where run folders go (default: ./aml-ppl-demo)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="where the networks train (default: CUDA when there is a GPU)")
    demo.add_argument("--debug", action="store_true", help="show tracebacks")
    fitting = commands.add_parser(
        "fit", help="fit a built-in model to a CSV or Parquet file",
        description="Fit a built-in model; print the ArviZ summary; write NetCDF, the posterior and a figure to --out.",
    )
    fitting.add_argument("model", choices=MODELS, help="blr, logistic, gp, gmm or bnn")
    fitting.add_argument("data", type=Path, help="a CSV (with a header row) or Parquet file")
    fitting.add_argument("--target", help="the response column (all models but gmm)")
    columns = fitting.add_mutually_exclusive_group()
    columns.add_argument("--features", nargs="+", help="the feature columns (default: all but the target)")
    columns.add_argument("--drop", nargs="+", help="columns to leave out (an id column, say)")
    fitting.add_argument("--engine", help="svi, map, laplace, nuts, chees, exact or em (default: the model's own)")
    fitting.add_argument("--num-samples", type=int, help="NUTS or ChEES draws per chain")
    fitting.add_argument("--warmup-steps", type=int, help="NUTS or ChEES warm-up steps")
    fitting.add_argument("--num-chains", type=int, help="NUTS or ChEES chains")
    fitting.add_argument("--num-steps", type=int, help="SVI, MAP or Laplace (its MAP) optimisation steps")
    fitting.add_argument("--n-init", type=int, help=f"EM starts (gmm default: {DEFAULT_MIXTURE_STARTS})")
    fitting.add_argument("--components", type=int, default=2, help="mixture components (gmm)")
    fitting.add_argument("--no-intercept", action="store_true", help="no intercept column (blr, logistic)")
    fitting.add_argument("--dropna", action="store_true", help="drop rows with missing values")
    fitting.add_argument("--seed", type=int, default=0)
    fitting.add_argument("--out", type=Path, default=Path("aml-ppl-fit"), help="output folder (default: ./aml-ppl-fit)")
    fitting.add_argument("--debug", action="store_true", help="show tracebacks")
    return command


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    try:
        if options.command == "demo":
            demo_command(options)
        else:
            fit_command(options)
    except AmlPplError as error:
        if options.debug:
            raise
        print(f"aml-ppl: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # one line, not a traceback, for anything unforeseen
        if options.debug:
            raise
        print(f"aml-ppl: {type(error).__name__}: {error} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
