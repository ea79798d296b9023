"""The main demo: per-sample clipping and second-order optimizers on real data.

Run ``python -m curvature.demo``. It trains a small MLP on scikit-learn's bundled
handwritten digits (1797 images, 8x8): with plain SGD; with per-sample gradient clipping
(the core step of DP-SGD) whose per-sample norms come from :func:`curvature.capture` on
the training forward itself, with no second forward and without materializing
per-sample gradients; and with Adam, ``curvature.KFAC`` and ``curvature.EKFAC`` in the
same ordinary loop. It prints a comparison table.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import curvature


def load_digits_tensors(seed: int = 0):
    """Digits as float tensors, split 80/20 into train and test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - message for users
        raise SystemExit(
            "The demo needs scikit-learn's bundled digits: pip install 'torch-curvature[examples]'"
        ) from err
    data = load_digits()
    X = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    X, y = X[perm], y[perm]
    split = int(0.8 * len(y))
    return X[:split], y[:split], X[split:], y[split:]


def make_model() -> nn.Module:
    """The demo's MLP 64-128-10."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def train(clip: float | None, epochs: int, batch: int, lr: float, seed: int = 0) -> dict:
    """Train; with ``clip``, each sample's gradient is clipped to that norm first."""
    Xtr, ytr, Xte, yte = load_digits_tensors()
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_none = nn.CrossEntropyLoss(reduction="none")
    clipped_frac = []
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(ytr))
        for i in range(0, len(ytr), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            if clip is None:
                loss_none(model(Xtr[idx]), ytr[idx]).mean().backward()
            else:
                with curvature.capture(model) as cap:
                    out = model(Xtr[idx])
                losses = loss_none(out, ytr[idx])  # [N]
                norms = cap.per_sample_grad_norms(losses)  # [N], same graph
                scale = (clip / (norms + 1e-12)).clamp(max=1.0).detach()
                clipped_frac.append((scale < 1).float().mean().item())
                # sum_n min(1, C/|g_n|) g_n / N: reweighted losses, one ordinary backward
                (losses * scale).mean().backward()
            opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        test_acc = (model(Xte).argmax(1) == yte).float().mean().item()
        train_loss = loss_none(model(Xtr), ytr).mean().item()
    return {
        "train loss": train_loss,
        "test acc": test_acc,
        "seconds": seconds,
        "clipped": sum(clipped_frac) / len(clipped_frac) if clipped_frac else 0.0,
    }


def train_with(name: str, epochs: int, batch: int, seed: int = 0) -> dict:
    """Train the same MLP with Adam, KFAC or EKFAC (library defaults for the latter two)."""
    Xtr, ytr, Xte, yte = load_digits_tensors()
    torch.manual_seed(seed)
    model = make_model()
    loss_func = nn.CrossEntropyLoss()
    if name == "Adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        cls = {"KFAC": curvature.KFAC, "EKFAC": curvature.EKFAC}[name]
        opt = cls(model, lr=1e-2, damping=1e-3, fisher="mc", loss_func=loss_func)
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(ytr))
        for i in range(0, len(ytr), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            loss_func(model(Xtr[idx]), ytr[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - start
    if hasattr(opt, "close"):
        opt.close()
    with torch.no_grad():
        return {
            "train loss": loss_func(model(Xtr), ytr).item(),
            "test acc": (model(Xte).argmax(1) == yte).float().mean().item(),
            "seconds": seconds,
            "clipped": 0.0,
        }


def main(argv=None) -> None:
    """Train with and without per-sample clipping and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args(argv)
    print(
        f"curvature {curvature.__version__}, torch {torch.__version__}, digits 8x8, MLP 64-128-10"
    )
    rows = {
        "SGD": train(None, args.epochs, args.batch, args.lr),
        f"SGD + per-sample clip {args.clip}": train(args.clip, args.epochs, args.batch, args.lr),
        "Adam (lr 1e-3)": train_with("Adam", args.epochs, args.batch),
        "KFAC (MC Fisher, lr 1e-2)": train_with("KFAC", args.epochs, args.batch),
        "EKFAC (MC Fisher, lr 1e-2)": train_with("EKFAC", args.epochs, args.batch),
    }
    print("\n| method | train loss | test acc | time (s) | samples clipped |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['train loss']:.4f} | {r['test acc']:.3f} | {r['seconds']:.2f} | "
            f"{100 * r['clipped']:.0f}% |"
        )
    # the second user question: d y / d C for every element of a batched output
    C = torch.tensor(2.0, requires_grad=True)
    x = torch.randn(4, 3)
    y = C * x
    J = curvature.jacobian(y, C)
    print(f"\njacobian(y = C * x, C) has shape {tuple(J.shape)} and equals x: {torch.equal(J, x)}")


if __name__ == "__main__":
    main()
