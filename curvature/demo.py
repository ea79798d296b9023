"""The main demo: KFAC, EKFAC and Adam (and SGD, per-sample clipping) on real data.

Run ``python -m curvature.demo``. It trains the same small MLP from the same
initialization, on the same batches, with each optimizer in an ordinary PyTorch loop:

* scikit-learn's bundled handwritten digits by default (1797 images, 8x8; no download);
* Fashion-MNIST with ``--dataset fashion-mnist``: from the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) or from
  ``--data-dir PATH`` holding the four ``*-idx?-ubyte`` files (``.gz`` or not);
  both loaded by :mod:`curvature.demo_data`.

Optimizers: plain SGD; SGD with per-sample gradient clipping (the core step of DP-SGD),
whose per-sample norms come from :func:`curvature.capture` on the training forward
itself (no second forward, no per-sample gradients materialized); Adam;
``curvature.KFAC`` and ``curvature.EKFAC``. Adam's learning rate is tuned on the same
data and seed: every value of ``--adam-lrs`` (default :data:`ADAM_GRID`, 5 log-spaced
values) trains in full, and the one that reaches the target training loss in the fewest
steps is kept (ties and misses: the lowest final training loss); ``--no-tune`` uses
``--adam-lr`` alone. It shows progress bars (with ``tqdm``), prints a table (final
training loss, test accuracy, wall time, steps and wall time to the target training
loss, and that time as a multiple of the tuned Adam's) and saves a figure of the loss
curves against wall time and steps (with ``matplotlib``). ``--device auto`` trains on
the GPU when there is one. One seed, one run per optimizer: for time-to-target over
several seeds and tuned baselines, see the repository's ``benchmarks/training.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

import curvature

from .demo_data import EXTRA, FASHION_DIR, Data, load_data

# name -> (label in the table, description of the settings)
OPTIMIZERS = {
    "sgd": "SGD",
    "clip": "SGD + per-sample clip",
    "adam": "Adam",
    "kfac": "KFAC",
    "ekfac": "EKFAC",
}
#: Adam's learning rates tried by default: 5 values, half a decade apart
ADAM_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
DEFAULTS = {  # per dataset: epochs, hidden width, target training loss
    "digits": {"epochs": 10, "hidden": 128, "target": 0.1, "subsample": None},
    "fashion-mnist": {"epochs": 3, "hidden": 256, "target": 0.4, "subsample": 20000},
}


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


def train(
    name: str, data: Data, args, device: torch.device, desc: Optional[str] = None
) -> Dict[str, Any]:
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
    total_steps = args.epochs * steps_per_epoch
    bar = progress_bar(total_steps, desc or OPTIMIZERS[name], steps_per_epoch, args.progress)
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
    hit = [i for i, loss in enumerate(history["loss"]) if loss <= args.target_loss]
    first = hit[0] if hit else None
    return {
        "optimizer": OPTIMIZERS[name],
        "label": OPTIMIZERS[name],
        "settings": settings(name, args),
        "train_loss": history["loss"][-1],
        "test_loss": test_loss,
        "test_acc": test_acc,
        "seconds": elapsed,
        "time_to_target": None if first is None else history["time"][first],
        "steps_to_target": None if first is None else history["step"][first],
        "epochs_to_target": None if first is None else history["epoch"][first],
        "clipped": sum(clipped) / len(clipped) if clipped else None,
        "steps_per_epoch": steps_per_epoch,
        "eval_every": eval_every,
        "history": history,
    }


def tuning_rank(result: Dict[str, Any]) -> tuple:
    """Sort key of a grid run: fewest steps to the target, then lowest final training loss.

    Steps, not seconds: every point of Adam's grid costs the same per step, so steps rank
    them as wall time would, without the timing noise. A run that misses the target ranks
    after every run that reaches it; a non-finite loss ranks last.
    """
    steps = result["steps_to_target"]
    loss = result["train_loss"]
    return (
        math.inf if steps is None else steps,
        loss if math.isfinite(loss) else math.inf,
    )


def tune_adam(data: Data, args, device: torch.device) -> Dict[str, Any]:
    """Adam trained with every learning rate of ``args.adam_lrs``; the best run by
    :func:`tuning_rank`, with the whole grid's outcome under ``"grid"``.
    """
    runs = []
    for lr in args.adam_lrs:
        point = argparse.Namespace(**{**vars(args), "adam_lr": lr})
        runs.append((lr, train("adam", data, point, device, desc=f"Adam lr {lr:g}")))
    lr, best = min(runs, key=lambda run: tuning_rank(run[1]))
    keys = ("train_loss", "seconds", "steps_to_target", "time_to_target")
    best["grid"] = [{"lr": x, **{k: r[k] for k in keys}} for x, r in runs]
    best["lr"] = lr
    best["label"] = f"Adam, tuned lr {lr:g}"
    grid = ", ".join(f"{x:g}" for x in args.adam_lrs)
    best["settings"] = f"lr {lr:g}, tuned over {grid}"
    return best


# -- report -------------------------------------------------------------------------------
def table(results: Dict[str, Dict[str, Any]], target: float) -> str:
    """The comparison as a Markdown table.

    Per optimizer: the final training loss, test accuracy and training time, then the
    steps and wall time to the first evaluation at or below ``target``, and that time
    divided by Adam's (``results["adam"]``, tuned or not, when it reached the target).
    """
    adam = results.get("adam", {}).get("time_to_target")
    lines = [
        "| optimizer | settings | train loss | test acc | time (s) | "
        f"steps to loss {target:g} | time to loss {target:g} (s) | time to target / Adam's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results.values():
        t = r["time_to_target"]
        if t is None:
            steps = reach = ratio = "not reached"
        else:
            steps = f"{r['steps_to_target']} (epoch {r['epochs_to_target']:.2f})"
            reach = f"{t:.2f}"
            ratio = "-" if not adam else f"{t / adam:.2f}"
        extra = "" if r["clipped"] is None else f"; {100 * r['clipped']:.0f}% samples clipped"
        lines.append(
            f"| {r['optimizer']} | {r['settings']}{extra} | {r['train_loss']:.4f} | "
            f"{r['test_acc']:.3f} | {r['seconds']:.2f} | {steps} | {reach} | {ratio} |"
        )
    return "\n".join(lines)


def verdicts(results: Dict[str, Dict[str, Any]], target: float) -> List[str]:
    """One sentence per curvature optimizer: its time to ``target`` against Adam's."""
    adam = results.get("adam")
    if adam is None:
        return []
    who = "the tuned Adam" if "grid" in adam else "Adam (not tuned)"
    lines = []
    for name in ("kfac", "ekfac"):
        r = results.get(name)
        if r is None:
            continue
        label = r["optimizer"]
        if r["time_to_target"] is None:
            lines.append(f"{label} did not reach loss {target:g}.")
        elif not adam["time_to_target"]:  # None: missed; 0: below the target at step 0
            missed = "did not reach it" if adam["time_to_target"] is None else "started below it"
            lines.append(
                f"{label} reached loss {target:g} in {r['time_to_target']:.2f} s "
                f"({r['steps_to_target']} steps); {who} {missed}: no ratio."
            )
        else:
            ratio = r["time_to_target"] / adam["time_to_target"]
            lines.append(
                f"{label} reached loss {target:g} in {r['time_to_target']:.2f} s "
                f"({r['steps_to_target']} steps), {ratio:.2f}x the time of {who} "
                f"({adam['time_to_target']:.2f} s, {adam['steps_to_target']} steps)."
            )
    return lines


def grid_line(adam: Dict[str, Any], target: float) -> str:
    """What each learning rate of Adam's grid reached, and the one kept."""
    cells = []
    for p in adam["grid"]:
        if p["steps_to_target"] is None:
            cells.append(f"{p['lr']:g}: not reached (final loss {p['train_loss']:.4f})")
        else:
            cells.append(f"{p['lr']:g}: {p['steps_to_target']} steps, {p['time_to_target']:.2f} s")
    if any(p["steps_to_target"] is not None for p in adam["grid"]):
        why = "fewest steps to the target; then lowest final training loss"
    else:
        why = "none reached the target: lowest final training loss"
    return (
        f"Adam's learning rate, tuned on this data and seed (steps / time to loss "
        f"{target:g}): {'; '.join(cells)}. Kept: {adam['lr']:g} ({why})."
    )


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
        label = r.get("label", r["optimizer"])
        a1.semilogy(h["time"], h["loss"], label=label)
        a2.semilogy(h["step"], h["loss"], label=label)
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
    p.add_argument(
        "--adam-lrs",
        type=float,
        nargs="+",
        default=list(ADAM_GRID),
        metavar="LR",
        help="Adam's learning-rate grid: each trains in full; the fewest steps to the target "
        "loss wins (then the lowest final loss)",
    )
    p.add_argument(
        "--no-tune",
        dest="tune",
        action="store_false",
        help="skip the grid: Adam with --adam-lr only",
    )
    p.add_argument(
        "--adam-lr", type=float, default=1e-2, help="Adam's learning rate with --no-tune"
    )
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(not lr > 0 for lr in args.adam_lrs + [args.adam_lr]):
        parser.error(
            f"learning rates must be positive: --adam-lrs {args.adam_lrs}, --adam-lr {args.adam_lr}"
        )
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
    results = {}
    for name in args.optimizers:
        if name == "adam" and args.tune:
            results[name] = tune_adam(data, args, device)
        else:
            results[name] = train(name, data, args, device)
    if "adam" in results and not args.tune:
        results["adam"]["settings"] += " (not tuned)"
        results["adam"]["label"] = f"Adam, lr {args.adam_lr:g} (not tuned)"
    print("\n" + table(results, args.target_loss) + "\n")
    if "adam" in results and args.tune:
        print(grid_line(results["adam"], args.target_loss))
    for line in verdicts(results, args.target_loss):
        print(line)
    every = next(iter(results.values()))["eval_every"] if results else 0
    print(
        "\ntrain loss: mean cross-entropy on the training set"
        + (f" (first {args.eval_samples})" if len(data.ytr) > args.eval_samples else "")
        + f", evaluated every {every} steps (steps to the target: the first evaluation at or "
        "below it); time: training only, evaluations excluded. One seed, one run per "
        "optimizer, on a machine that may be busy: times vary from run to run."
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
