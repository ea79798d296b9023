"""The main demo: KFAC, EKFAC and Adam (and SGD, per-sample clipping) on real data.

Run ``python -m curvature.demo``. It trains the same small MLP from the same
initialization, on the same batches, with each optimizer in an ordinary PyTorch loop:

* scikit-learn's bundled handwritten digits by default (1797 images, 8x8; no download);
* Fashion-MNIST with ``--dataset fashion-mnist``: from the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) or from
  ``--data-dir PATH`` holding the four ``*-idx?-ubyte`` files (``.gz`` or not).

Optimizers: plain SGD; SGD with per-sample gradient clipping (the core step of DP-SGD),
whose per-sample norms come from :func:`curvature.capture` on the training forward
itself (no second forward, no per-sample gradients materialized); Adam;
``curvature.KFAC`` and ``curvature.EKFAC``. It shows progress bars (with ``tqdm``),
prints a table (final training loss, test accuracy, wall time, time to a target training
loss) and saves a figure of the loss curves against wall time and steps (with
``matplotlib``). ``--device auto`` trains on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

import curvature

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
EXTRA = "pip install 'torch-curvature[examples]'"

# name -> (label in the table, description of the settings)
OPTIMIZERS = {
    "sgd": "SGD",
    "clip": "SGD + per-sample clip",
    "adam": "Adam",
    "kfac": "KFAC",
    "ekfac": "EKFAC",
}
DEFAULTS = {  # per dataset: epochs, hidden width, target training loss
    "digits": {"epochs": 10, "hidden": 128, "target": 0.1, "subsample": None},
    "fashion-mnist": {"epochs": 3, "hidden": 256, "target": 0.4, "subsample": 20000},
}


# -- data ---------------------------------------------------------------------------------
@dataclass
class Data:
    """Train and test tensors (inputs flattened, scaled to [0, 1]) and a description."""

    Xtr: Tensor
    ytr: Tensor
    Xte: Tensor
    yte: Tensor
    name: str

    @property
    def description(self) -> str:
        """One line: the name and the sizes."""
        return (
            f"{self.name}: {len(self.ytr)} training / {len(self.yte)} test samples, "
            f"{self.Xtr.shape[1]} features, {int(self.ytr.max()) + 1} classes"
        )


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format; gzip-compressed when the name ends in ``.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX data type 0x{raw[2]:02x}")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} values for shape {shape}")
    return data.reshape(shape)


def _find(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(os.path.join(data_dir, stem + "[.gz]"))


def fashion_mnist_files(data_dir: Optional[str] = None) -> Dict[str, str]:
    """The four IDX files of Fashion-MNIST in ``data_dir`` or the Debian package's folder."""
    folder = data_dir or FASHION_DIR
    try:
        return {key: _find(folder, stem) for key, stem in FASHION_FILES.items()}
    except FileNotFoundError as err:
        hint = (
            "pass --data-dir PATH (a folder with train-images-idx3-ubyte[.gz], "
            "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], "
            "t10k-labels-idx1-ubyte[.gz])"
        )
        if data_dir is None:
            hint = "install the Debian package (apt-get install dataset-fashion-mnist) or " + hint
        raise SystemExit(f"Fashion-MNIST not found: missing {err.args[0]}; {hint}") from err


def _split(X: Tensor, y: Tensor, seed: int):
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    X, y = X[perm], y[perm]
    split = int(0.8 * len(y))
    return X[:split], y[:split], X[split:], y[split:]


def load_digits_tensors(seed: int = 0):
    """Scikit-learn's digits as float tensors in [0, 1], split 80/20 into train and test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - message for users
        raise SystemExit(f"The demo needs scikit-learn's bundled digits: {EXTRA}") from err
    data = load_digits()
    X = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return _split(X, torch.tensor(data.target), seed)


def load_data(
    dataset: str = "digits",
    data_dir: Optional[str] = None,
    subsample: Optional[int] = None,
    seed: int = 0,
) -> Data:
    """Load ``"digits"`` or ``"fashion-mnist"``; ``subsample`` keeps that many training samples."""
    if dataset == "digits":
        Xtr, ytr, Xte, yte = load_digits_tensors(seed)
        name = "digits 8x8 (scikit-learn)"
    elif dataset == "fashion-mnist":
        files = fashion_mnist_files(data_dir)
        arrays = {key: read_idx(path) for key, path in files.items()}

        def images(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a.reshape(len(a), -1).astype(np.float32) / 255.0)

        Xtr, ytr = images(arrays["train_images"]), torch.from_numpy(arrays["train_labels"].copy())
        Xte, yte = images(arrays["test_images"]), torch.from_numpy(arrays["test_labels"].copy())
        ytr, yte = ytr.long(), yte.long()
        name = f"Fashion-MNIST 28x28 ({os.path.dirname(files['train_images'])})"
    else:
        raise ValueError(f"dataset={dataset!r}: 'digits' or 'fashion-mnist'")
    if subsample is not None and subsample < len(ytr):
        idx = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed + 1))
        Xtr, ytr = Xtr[idx[:subsample]], ytr[idx[:subsample]]
    return Data(Xtr, ytr, Xte, yte, name)


# -- training -----------------------------------------------------------------------------
def make_model(in_features: int = 64, hidden: int = 128, classes: int = 10) -> nn.Module:
    """The demo's MLP ``in-hidden-classes`` with a ReLU."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def make_optimizer(name: str, model: nn.Module, loss_func: nn.Module, args) -> Any:
    """The optimizer called ``name`` (a key of :data:`OPTIMIZERS`) with the demo's settings."""
    if name in ("sgd", "clip"):
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.adam_lr)
    cls = {"kfac": curvature.KFAC, "ekfac": curvature.EKFAC}[name]
    return cls(
        model,
        lr=args.kfac_lr,
        damping=args.damping,
        fisher="mc",
        loss_func=loss_func,
        kl_clip=args.kl_clip or None,
    )


def settings(name: str, args) -> str:
    """The hyperparameters of optimizer ``name`` as a short string."""
    if name == "sgd":
        return f"lr {args.lr:g}, momentum 0.9"
    if name == "clip":
        return f"lr {args.lr:g}, momentum 0.9, clip {args.clip:g}"
    if name == "adam":
        return f"lr {args.adam_lr:g}"
    clip = f", KL clip {args.kl_clip:g}" if args.kl_clip else ""
    return f"lr {args.kfac_lr:g}, damping {args.damping:g}{clip}, MC Fisher"


class _PlainBar:
    """Stands in for tqdm: one line at the end of each epoch."""

    def __init__(self, total: int, desc: str, steps_per_epoch: int, disable: bool = False):
        self.total, self.desc, self.per_epoch, self.disable = total, desc, steps_per_epoch, disable
        self.n, self.postfix = 0, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.disable and (self.n % self.per_epoch == 0 or self.n == self.total):
            epoch = -(-self.n // self.per_epoch)
            print(f"{self.desc}: epoch {epoch}, step {self.n}/{self.total} {self.postfix}")

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, steps_per_epoch: int, enabled: bool = True):
    """A ``tqdm`` bar on stderr, or plain progress lines when tqdm is not installed."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=f"{desc:>22}", unit="step", leave=True)
        except ImportError:
            pass
    return _PlainBar(total, desc, steps_per_epoch, disable=not enabled)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, X: Tensor, y: Tensor, chunk: int = 8192):
    """Mean cross-entropy and accuracy of ``model`` on ``(X, y)`` (in eval mode, so that
    the optimizers' hooks, which follow training-mode forwards, ignore it).
    """
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(y), chunk):
        out = model(X[i : i + chunk])
        loss += nn.functional.cross_entropy(out, y[i : i + chunk], reduction="sum").item()
        correct += (out.argmax(1) == y[i : i + chunk]).sum().item()
    model.train(was_training)
    return loss / len(y), correct / len(y)


def _step(name: str, model: nn.Module, opt: Any, X: Tensor, y: Tensor, args) -> Optional[float]:
    """One training step; with ``name == "clip"`` the fraction of samples clipped."""
    opt.zero_grad()
    frac = None
    if name == "clip":
        with curvature.capture(model) as cap:
            out = model(X)
        losses = nn.functional.cross_entropy(out, y, reduction="none")  # [N]
        norms = cap.per_sample_grad_norms(losses)  # [N], from the same graph
        scale = (args.clip / (norms + 1e-12)).clamp(max=1.0).detach()
        frac = (scale < 1).float().mean().item()
        # sum_n min(1, C/|g_n|) g_n / N: reweighted losses, one ordinary backward
        (losses * scale).mean().backward()
    else:
        nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    return frac


def warm_up(name: str, model: nn.Module, X: Tensor, y: Tensor, args) -> None:
    """Two untimed steps on a throwaway copy: one-time setup costs stay out of the timings."""
    twin = copy.deepcopy(model)
    opt = make_optimizer(name, twin, nn.CrossEntropyLoss(), args)
    for _ in range(2):
        _step(name, twin, opt, X, y, args)
    if hasattr(opt, "close"):
        opt.close()


def train(name: str, data: Data, args, device: torch.device) -> Dict[str, Any]:
    """Train a fresh MLP (same seed for every optimizer) and record the loss curve.

    The training loss on the whole training set (at most ``args.eval_samples`` of it) is
    evaluated about four times per epoch with the clock paused, so that ``time`` counts
    training only.
    """
    Xtr, ytr = data.Xtr.to(device), data.ytr.to(device)
    Xte, yte = data.Xte.to(device), data.yte.to(device)
    Xev, yev = Xtr[: args.eval_samples], ytr[: args.eval_samples]
    torch.manual_seed(args.seed)
    model = make_model(Xtr.shape[1], args.hidden, int(data.ytr.max()) + 1).to(device)
    loss_func = nn.CrossEntropyLoss()
    opt = make_optimizer(name, model, loss_func, args)
    order = torch.Generator().manual_seed(args.seed)  # the same batches for every optimizer
    n, batch = len(ytr), args.batch
    steps_per_epoch = -(-n // batch)
    eval_every = max(1, steps_per_epoch // 4)
    history: Dict[str, List[float]] = {"step": [], "epoch": [], "time": [], "loss": []}
    clipped: List[float] = []
    elapsed = 0.0

    def record(step: int) -> float:
        loss = evaluate(model, Xev, yev)[0]
        history["step"].append(step)
        history["epoch"].append(step / steps_per_epoch)
        history["time"].append(elapsed)
        history["loss"].append(loss)
        return loss

    warm_up(name, model, Xtr[:batch], ytr[:batch], args)
    bar = progress_bar(
        args.epochs * steps_per_epoch, OPTIMIZERS[name], steps_per_epoch, args.progress
    )
    record(0)
    step = 0
    for _ in range(args.epochs):
        perm = torch.randperm(n, generator=order).to(device)
        _sync(device)
        start = time.perf_counter()
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            frac = _step(name, model, opt, Xtr[idx], ytr[idx], args)
            if frac is not None:
                clipped.append(frac)
            step += 1
            bar.update(1)
            if step % eval_every == 0 or step % steps_per_epoch == 0:
                _sync(device)
                elapsed += time.perf_counter() - start
                bar.set_postfix_str(f"loss {record(step):.4f}")
                _sync(device)
                start = time.perf_counter()
    bar.close()
    if hasattr(opt, "close"):
        opt.close()
    test_loss, test_acc = evaluate(model, Xte, yte)
    reached = [t for t, loss in zip(history["time"], history["loss"]) if loss <= args.target_loss]
    reached_epoch = [
        e for e, loss in zip(history["epoch"], history["loss"]) if loss <= args.target_loss
    ]
    return {
        "optimizer": OPTIMIZERS[name],
        "settings": settings(name, args),
        "train_loss": history["loss"][-1],
        "test_loss": test_loss,
        "test_acc": test_acc,
        "seconds": elapsed,
        "time_to_target": reached[0] if reached else None,
        "epochs_to_target": reached_epoch[0] if reached_epoch else None,
        "clipped": sum(clipped) / len(clipped) if clipped else None,
        "steps_per_epoch": steps_per_epoch,
        "history": history,
    }


# -- report -------------------------------------------------------------------------------
def table(results: Dict[str, Dict[str, Any]], target: float) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| optimizer | settings | train loss | test acc | time (s) | "
        f"time to loss {target:g} (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results.values():
        if r["time_to_target"] is None:
            reach = "not reached"
        else:
            reach = f"{r['time_to_target']:.2f} (epoch {r['epochs_to_target']:.2f})"
        extra = "" if r["clipped"] is None else f"; {100 * r['clipped']:.0f}% samples clipped"
        lines.append(
            f"| {r['optimizer']} | {r['settings']}{extra} | {r['train_loss']:.4f} | "
            f"{r['test_acc']:.3f} | {r['seconds']:.2f} | {reach} |"
        )
    return "\n".join(lines)


def plot(results: Dict[str, Dict[str, Any]], path: str, title: str, target: float) -> bool:
    """Save the loss curves against wall time and steps; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results.values():
        h = r["history"]
        a1.semilogy(h["time"], h["loss"], label=r["optimizer"])
        a2.semilogy(h["step"], h["loss"], label=r["optimizer"])
    a1.set_xlabel("wall time (s, training only)")
    per_epoch = next(iter(results.values()), {}).get("steps_per_epoch")
    a2.set_xlabel(f"step ({per_epoch} per epoch)" if per_epoch else "step")
    for a in (a1, a2):
        a.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target loss {target:g}")
        a.set_ylabel("training loss")
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def pick_device(name: str) -> torch.device:
    """``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"`` (error when unavailable)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available (torch {torch.__version__})")
    return torch.device(name)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` where the default is a value, not ``None`` or a flag's."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line: every option with help and its default."""
    p = argparse.ArgumentParser(
        prog="python -m curvature.demo",
        description=__doc__.splitlines()[0],
        formatter_class=_HelpFormatter,
    )
    dig, fm = DEFAULTS["digits"], DEFAULTS["fashion-mnist"]

    def per_dataset(what: str, key: str) -> str:
        return f"{what} (default: {dig[key]} for digits, {fm[key]} for fashion-mnist)"

    p.add_argument(
        "--dataset",
        choices=sorted(DEFAULTS),
        default="digits",
        help="digits: scikit-learn's bundled 8x8 digits; fashion-mnist: 28x28 images from "
        "--data-dir or the Debian package dataset-fashion-mnist",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help=f"folder with the Fashion-MNIST IDX files (default: {FASHION_DIR})",
    )
    p.add_argument(
        "--subsample",
        type=int,
        default=None,
        help="training samples to keep, 0 for all (default: all for digits, "
        f"{fm['subsample']} for fashion-mnist)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        default=list(OPTIMIZERS),
        metavar="NAME",
        help=f"optimizers to compare, from {', '.join(OPTIMIZERS)}",
    )
    p.add_argument("--epochs", type=int, default=None, help=per_dataset("epochs", "epochs"))
    p.add_argument("--batch", type=int, default=64, help="batch size")
    p.add_argument("--hidden", type=int, default=None, help=per_dataset("hidden width", "hidden"))
    p.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (momentum 0.9)")
    p.add_argument("--clip", type=float, default=1.0, help="per-sample gradient norm bound")
    p.add_argument("--adam-lr", type=float, default=1e-2, help="Adam's learning rate")
    p.add_argument("--kfac-lr", type=float, default=3e-2, help="KFAC's and EKFAC's learning rate")
    p.add_argument("--damping", type=float, default=1e-3, help="KFAC's and EKFAC's damping")
    p.add_argument(
        "--kl-clip", type=float, default=1e-3, help="KFAC's and EKFAC's KL clipping; 0: none"
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help=per_dataset("the training loss whose first crossing is timed", "target"),
    )
    p.add_argument(
        "--eval-samples", type=int, default=10000, help="training samples for the loss curves"
    )
    p.add_argument("--figure", default="curvature_demo.png", help="PNG path; '' for none")
    p.add_argument("--json", default=None, help="write the results (curves included) to this path")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and batches")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bars (nor the plain per-epoch lines printed without tqdm)",
    )
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The demo's command line (dataset-dependent defaults filled in)."""
    args = build_parser().parse_args(argv)
    d = DEFAULTS[args.dataset]
    args.epochs = args.epochs if args.epochs is not None else d["epochs"]
    args.hidden = args.hidden if args.hidden is not None else d["hidden"]
    args.target_loss = args.target_loss if args.target_loss is not None else d["target"]
    if args.subsample is None:
        args.subsample = d["subsample"]
    elif args.subsample <= 0:
        args.subsample = None
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Train with every optimizer, print the table, save the figure; return the results."""
    args = parse_args(argv)
    device = pick_device(args.device)
    total = time.perf_counter()
    data = load_data(args.dataset, args.data_dir, args.subsample, args.seed)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    where += f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    title = f"{data.name}, MLP {data.Xtr.shape[1]}-{args.hidden}-{int(data.ytr.max()) + 1}"
    print(f"curvature {curvature.__version__}, torch {torch.__version__}, {device} ({where})")
    print(f"{data.description}; MLP {data.Xtr.shape[1]}-{args.hidden}-{int(data.ytr.max()) + 1}")
    print(f"{args.epochs} epochs of batch {args.batch}, same initialization and batches for all")
    sys.stdout.flush()
    results = {name: train(name, data, args, device) for name in args.optimizers}
    print("\n" + table(results, args.target_loss))
    print(
        "\ntrain loss: mean cross-entropy on the training set"
        + (f" (first {args.eval_samples})" if len(data.ytr) > args.eval_samples else "")
        + "; time: training only, evaluations excluded."
    )
    if args.figure:
        if plot(results, args.figure, title, args.target_loss):
            print(f"figure of the loss curves: {os.path.abspath(args.figure)}")
        else:
            print(f"matplotlib is not installed: no figure ({EXTRA})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
        print(f"results: {os.path.abspath(args.json)}")
    # the second user question: d y / d C for every element of a batched output, no loop
    C = torch.tensor(2.0, requires_grad=True)
    x = torch.randn(4, 3)
    J = curvature.jacobian(C * x, C)
    print(f"jacobian(y = C * x, C) has shape {tuple(J.shape)} and equals x: {torch.equal(J, x)}")
    print(f"demo finished in {time.perf_counter() - total:.1f} s")
    return results


if __name__ == "__main__":
    main()
