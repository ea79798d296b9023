"""How good are KFAC, EKFAC, diagonal and empirical Fishers on a real classifier?

Trains a small MLP (30-16-2) on scikit-learn's breast-cancer data with Adam for a few
epochs, then compares each approximation with the exact GGN on 256 training points:
relative Frobenius errors per layer, cosines of damped natural-gradient directions and
top eigenvalues. Prints a Markdown table and, with matplotlib, saves a figure.

    python examples/fisher_study.py [--dataset digits] [--figure fisher_study.png]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import curvature
from curvature.study import compare_approximations


def load(name: str):
    from sklearn import datasets

    data = datasets.load_breast_cancer() if name == "breast_cancer" else datasets.load_digits()
    X = torch.tensor(data.data, dtype=torch.float64)
    X = (X - X.mean(0)) / X.std(0).clamp_min(1e-8)
    return X, torch.tensor(data.target)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["breast_cancer", "digits"], default="breast_cancer")
    parser.add_argument("--points", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--damping", type=float, default=1e-3)
    parser.add_argument("--figure", default=None, help="save a figure here (needs matplotlib)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    X, y = load(args.dataset)
    C = int(y.max()) + 1
    model = nn.Sequential(nn.Linear(X.shape[1], args.hidden), nn.Tanh(), nn.Linear(args.hidden, C))
    model = model.double()
    loss_func = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(args.epochs):
        for i in range(0, len(y), 64):
            opt.zero_grad()
            loss_func(model(X[i : i + 64]), y[i : i + 64]).backward()
            opt.step()
    idx = torch.randperm(len(y))[: args.points]
    data = (X[idx], y[idx])
    P = sum(p.numel() for p in model.parameters())
    print(f"{args.dataset}: MLP {X.shape[1]}-{args.hidden}-{C}, P = {P}, N = {len(idx)}")
    start = time.perf_counter()
    result = compare_approximations(
        model,
        loss_func,
        data,
        ["kfac", "ekfac", "ef-kfac", "mc-kfac-1", "mc-kfac-16", "diag-ggn", "diag-ef", "ef"],
        damping=args.damping,
    )
    print(result.table())
    print(f"({time.perf_counter() - start:.1f} s; curvature {curvature.__version__})")
    if args.figure:
        try:
            result.plot(args.figure)
            print(f"figure saved to {args.figure}")
        except ImportError:
            print("matplotlib is not installed: no figure")


if __name__ == "__main__":
    main()
