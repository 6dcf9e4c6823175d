"""The aml-ppl command."""

import torch

from aml_ppl.cli import main


def write_csv(path, header, rows):
    path.write_text(",".join(header) + "\n" + "\n".join(",".join(f"{v:.6f}" for v in row) for row in rows) + "\n")


def test_fit_blr_from_csv_prints_a_summary_and_saves(tmp_path, capsys):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, dtype=torch.float64, generator=generator)
    y = 1.0 + X @ torch.tensor([2.0, -1.0], dtype=torch.float64) + 0.1 * torch.randn(40, dtype=torch.float64, generator=generator)
    write_csv(tmp_path / "data.csv", ["a", "b", "y"], torch.cat([X, y[:, None]], 1).tolist())
    code = main(["fit", str(tmp_path / "data.csv"), "--target", "y", "--intercept", "--save", str(tmp_path / "post.pt")])
    printed = capsys.readouterr().out
    assert code == 0 and "blr by exact" in printed and "beta[2]" in printed
    assert (tmp_path / "post.pt").exists()


def test_fit_gmm_and_errors(tmp_path, capsys):
    generator = torch.Generator().manual_seed(1)
    points = torch.cat([torch.randn(30, 2, generator=generator) - 3, torch.randn(30, 2, generator=generator) + 3])
    write_csv(tmp_path / "points.csv", ["u", "v"], points.tolist())
    assert main(["fit", str(tmp_path / "points.csv"), "--model", "gmm"]) == 0
    assert "gmm by em" in capsys.readouterr().out
    assert main(["fit", str(tmp_path / "points.csv"), "--target", "w"]) == 2
    assert "not a column" in capsys.readouterr().err
