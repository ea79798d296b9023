"""Do the optimizers converge at their defaults on ordinary small models?

    python benchmarks/defaults_survey.py [--models mlp_tanh,cnn,...] [--optimizers kfac,...]
        [--seeds 0,1,2] [--steps 300] [--json benchmarks/results/defaults_survey.json]

Twelve small models on bundled data (sklearn's digits and breast cancer, standardized; a
synthetic bag-of-tokens task): MLPs (tanh; ReLU with LayerNorm), CNNs (plain, BatchNorm,
dropout), logistic regression and an MLP with ``BCEWithLogitsLoss``, an LSTM reading each
digit as 8 rows, a one-layer transformer (``transformer``: a positional ``nn.Parameter``
on the root model with the encoder layer's default dropout; ``transformer2``: the same
parameter in a submodule), an autoencoder with ``MSELoss``, an embedding bag. Each model
trains 300 steps at batch 64 (shuffled, one thread) with ``KFAC(model)``,
``EKFAC(model)``, ``DiagonalNaturalGradient(model)``, ``KFAC(model, fisher="mc",
loss_func=...)`` at their defaults and with ``torch.optim.Adam(lr=1e-3)`` (the reference
of an untuned default, not a tuned baseline: this is a convergence check at equal steps,
not a time comparison; benchmarks/training.py is that). The table gives the training
loss on the whole training set after the last step (eval mode), the mean over the
seeds; ``diverged`` where the loss became non-finite, ``error`` where the library
refused the model (the message is printed). A helper session's survey found the
``nn.MultiheadAttention`` empirical-Fisher bug of 2026-11-27 with this grid.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Dict, List

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from torch import nn

import curvature


def _std_split(X, y, seed=0):
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    sc = StandardScaler().fit(Xtr)
    return sc.transform(Xtr).astype(np.float32), sc.transform(Xte).astype(np.float32), ytr, yte


def digits():
    d = load_digits()
    Xtr, Xte, ytr, yte = _std_split(d.data, d.target)
    return (
        torch.tensor(Xtr),
        torch.tensor(ytr, dtype=torch.long),
        torch.tensor(Xte),
        torch.tensor(yte, dtype=torch.long),
    )


def cancer():
    d = load_breast_cancer()
    Xtr, Xte, ytr, yte = _std_split(d.data, d.target)
    return (
        torch.tensor(Xtr),
        torch.tensor(ytr, dtype=torch.float32).unsqueeze(1),
        torch.tensor(Xte),
        torch.tensor(yte, dtype=torch.float32).unsqueeze(1),
    )


def tokens():
    # synthetic bag-of-tokens: vocab 200, length 20; 4 classes, each with 10 indicative tokens
    g = torch.Generator().manual_seed(1234)
    n, L, V, C = 2000, 20, 200, 4
    y = torch.randint(0, C, (n,), generator=g)
    X = torch.randint(C * 10, V, (n, L), generator=g)  # background tokens
    k = 4  # indicative tokens per sequence
    ind = y[:, None] * 10 + torch.randint(0, 10, (n, k), generator=g)
    pos = torch.argsort(torch.rand(n, L, generator=g), dim=1)[:, :k]
    X.scatter_(1, pos, ind)
    return X[:1500], y[:1500], X[1500:], y[1500:]


class Rows(nn.Module):  # (N,64) -> (N,8,8)
    def forward(self, x):
        return x.view(-1, 8, 8)


class Img(nn.Module):  # (N,64) -> (N,1,8,8)
    def forward(self, x):
        return x.view(-1, 1, 8, 8)


class LSTMClf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.lstm(x.view(-1, 8, 8))
        return self.head(out[:, -1])


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 8, 32))
        self.enc = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, batch_first=True
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.enc(h).mean(1))


class PosEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(0.02 * torch.randn(1, 8, 32))

    def forward(self, h):
        return h + self.pos


class TinyTransformer2(nn.Module):
    """TinyTransformer with the positional parameter in a submodule (not on the root)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.posemb = PosEmb()
        self.enc = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, batch_first=True
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.enc(self.posemb(self.embed(x.view(-1, 8, 8)))).mean(1))


class BagOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 32)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def _digits_cnn(name):
    """Two convolutions on the 8x8 digits; ``cnn_bn`` with BatchNorm after each,
    ``cnn_dropout`` with dropout after the first and before the head."""
    bn, drop = name == "cnn_bn", name == "cnn_dropout"
    layers = [Img(), nn.Conv2d(1, 16, 3, padding=1)]
    layers += [nn.BatchNorm2d(16)] * bn + [nn.ReLU()] + [nn.Dropout(0.25)] * drop
    layers += [nn.Conv2d(16, 32, 3, stride=2, padding=1)]
    layers += [nn.BatchNorm2d(32)] * bn + [nn.ReLU(), nn.Flatten()] + [nn.Dropout(0.25)] * drop
    return nn.Sequential(*layers, nn.Linear(512, 10))


def build(name):
    """returns model, loss_func, data, kind ('clf','bin','ae')"""
    if name == "mlp_tanh":
        m = nn.Sequential(
            nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
        )
        return m, nn.CrossEntropyLoss(), digits(), "clf"
    if name == "mlp_relu_ln":
        m = nn.Sequential(
            nn.Linear(64, 128),
            nn.LayerNorm(128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.LayerNorm(128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        return m, nn.CrossEntropyLoss(), digits(), "clf"
    if name in ("cnn", "cnn_bn", "cnn_dropout"):
        return _digits_cnn(name), nn.CrossEntropyLoss(), digits(), "clf"
    if name == "logreg_bc":
        return nn.Sequential(nn.Linear(30, 1)), nn.BCEWithLogitsLoss(), cancer(), "bin"
    if name == "mlp_bc":
        m = nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 1))
        return m, nn.BCEWithLogitsLoss(), cancer(), "bin"
    if name == "lstm":
        return LSTMClf(), nn.CrossEntropyLoss(), digits(), "clf"
    if name == "transformer":
        return TinyTransformer(), nn.CrossEntropyLoss(), digits(), "clf"
    if name == "transformer2":
        return TinyTransformer2(), nn.CrossEntropyLoss(), digits(), "clf"
    if name == "autoencoder":
        m = nn.Sequential(
            nn.Linear(64, 32),
            nn.ReLU(),
            nn.Linear(32, 8),
            nn.ReLU(),
            nn.Linear(8, 32),
            nn.ReLU(),
            nn.Linear(32, 64),
        )
        Xtr, _, Xte, _ = digits()
        return m, nn.MSELoss(), (Xtr, Xtr, Xte, Xte), "ae"
    if name == "bag_tokens":
        return BagOfTokens(), nn.CrossEntropyLoss(), tokens(), "clf"
    raise KeyError(name)


MODELS = [
    "mlp_tanh",
    "mlp_relu_ln",
    "cnn",
    "cnn_bn",
    "cnn_dropout",
    "logreg_bc",
    "mlp_bc",
    "lstm",
    "transformer",
    "transformer2",
    "autoencoder",
    "bag_tokens",
]
OPTS = ["adam", "kfac", "ekfac", "dng", "kfac_mc", "ekfac_power"]


def make_opt(opt, model, loss_func, kw):
    if opt == "adam":
        return torch.optim.Adam(model.parameters(), **({"lr": 1e-3} | kw))
    if opt == "kfac":
        return curvature.KFAC(model, **kw)
    if opt == "ekfac":
        return curvature.EKFAC(model, **kw)
    if opt == "ekfac_power":
        return curvature.EKFAC(model, eigenbasis_update="power", **kw)
    if opt == "dng":
        return curvature.DiagonalNaturalGradient(model, **kw)
    if opt == "kfac_mc":
        return curvature.KFAC(model, fisher="mc", loss_func=loss_func, **kw)
    raise KeyError(opt)


def metrics(model, loss_func, X, y, kind):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(X)
        loss = loss_func(out, y).item()
        if kind == "clf":
            acc = (out.argmax(1) == y).float().mean().item()
        elif kind == "bin":
            acc = ((out > 0).float() == y).float().mean().item()
        else:
            acc = None
    model.train(was)
    return loss, acc


def run(model_name, opt_name, seed, steps=300, kw=None, batch=64, verbose=False):
    kw = kw or {}
    torch.manual_seed(seed)
    model, loss_func, (Xtr, ytr, Xte, yte), kind = build(model_name)
    model.train()
    rec = dict(
        model=model_name,
        opt=opt_name,
        seed=seed,
        kw=kw,
        steps=steps,
        curve=[],
        batch_curve=[],
        warnings=[],
        error=None,
        diverged_at=None,
    )
    t0 = time.time()
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        try:
            opt = make_opt(opt_name, model, loss_func, kw)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"construct: {type(e).__name__}: {e}"
            opt = None
        if opt is not None:
            g = torch.Generator().manual_seed(seed)
            n = Xtr.shape[0]
            perm, pos = torch.randperm(n, generator=g), 0
            rec["curve"].append((0, *metrics(model, loss_func, Xtr, ytr, kind)))
            acc_b = []
            try:
                for step in range(1, steps + 1):
                    if pos + batch > n:
                        perm, pos = torch.randperm(n, generator=g), 0
                    idx = perm[pos : pos + batch]
                    pos += batch
                    opt.zero_grad()
                    loss = loss_func(model(Xtr[idx]), ytr[idx])
                    loss.backward()
                    opt.step()
                    acc_b.append(loss.item())
                    if verbose:
                        print(step, loss.item(), flush=True)
                    if not math.isfinite(acc_b[-1]) and rec["diverged_at"] is None:
                        rec["diverged_at"] = step
                    if step % 25 == 0:
                        rec["batch_curve"].append((step, float(np.mean(acc_b))))
                        acc_b = []
                        rec["curve"].append((step, *metrics(model, loss_func, Xtr, ytr, kind)))
                        if not math.isfinite(rec["curve"][-1][1]) and rec["diverged_at"] is None:
                            rec["diverged_at"] = step
                    if rec["diverged_at"] is not None:
                        break
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"step {step}: {type(e).__name__}: {e}"
            rec["train"] = metrics(model, loss_func, Xtr, ytr, kind)
            rec["test"] = metrics(model, loss_func, Xte, yte, kind)
            if hasattr(opt, "close"):
                opt.close()
        seen = {}
        for w in wlist:
            key = f"{w.category.__name__}: {w.message}"
            if key not in seen:
                seen[key] = f"{os.path.basename(w.filename)}:{w.lineno}"
        rec["warnings"] = [f"{k}  [{v}]" for k, v in seen.items()]
    rec["time_s"] = time.time() - t0
    return rec


def table(records: List[Dict[str, Any]], models: List[str], opts: List[str]) -> str:
    """The markdown table of the final training losses (mean over seeds)."""
    lines = ["| model | " + " | ".join(opts) + " |", "|---" * (len(opts) + 1) + "|"]
    for m in models:
        cells = []
        for o in opts:
            rs = [r for r in records if r["model"] == m and r["opt"] == o]
            if not rs:
                cells.append("")
            elif any(r["error"] for r in rs):
                cells.append("error")
            elif any(r["diverged_at"] for r in rs):
                cells.append("diverged")
            else:
                cells.append(f"{np.mean([r['train'][0] for r in rs]):.2g}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--optimizers", default=",".join(OPTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args()
    torch.set_num_threads(1)
    models, opts = args.models.split(","), args.optimizers.split(",")
    records = []
    for m in models:
        for o in opts:
            for s in (int(x) for x in args.seeds.split(",")):
                rec = run(m, o, s, args.steps)
                records.append(rec)
                note = rec["error"] or (
                    f"diverged at {rec['diverged_at']}" if rec["diverged_at"] else ""
                )
                print(
                    f"{m:13s} {o:8s} seed {s}: loss {rec.get('train', (math.nan,))[0]:.4g} "
                    f"({rec['time_s']:.1f} s) {note}",
                    flush=True,
                )
    print()
    print(table(records, models, opts))
    errors = {r["error"].split(": ", 1)[-1] for r in records if r["error"]}
    for e in sorted(errors):
        print(f"\nerror: {e}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "records": records}, f)


if __name__ == "__main__":
    main()
