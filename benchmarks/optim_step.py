"""Time of one optimizer step (forward, backward, statistics, update) against a plain
forward+backward, for KFAC / EKFAC / DiagonalNaturalGradient and SGD / Adam.

    python benchmarks/optim_step.py [--quick] [--json PATH] [--no-doc] [--device cuda]

Workloads: MLP 784-512-256-10 at batch 128; a CNN on 3x32x32 at batch 64 (with a
12544->128 Linear, as in shared/PERFORMANCE.md); a token MLP 128-256-128 on [32, 64, 128];
with ``--workloads resnet18`` (not run by default) benchmarks/training.py's ResNet-18 with
BatchNorm (width 16, 1x28x28 inputs) at batch 128.
The ratio includes the amortized decompositions (``inverse_every=10``): each timed call
is 10 consecutive training steps (one refresh period), against 10 plain steps.
``--device cuda`` runs the same workloads on the GPU (each timed call ends with
``torch.cuda.synchronize()``) and writes its own section of docs/benchmarks.md.

When ASDL is installed (``pip install asdfghjkl``, import ``asdl``), its KFAC training step
is measured in the same run, the same way ("ASDL KFAC empirical" and "ASDL KFAC mc-1",
right after ours): ``KfacGradientMaker`` with statistics every step, inverses every 10
steps (``curvature_upd_interval=1``, ``preconditioner_upd_interval=10``), the same damping
(pi, ``1e-2``) and factor average (``ema_decay = 1 - factor_decay = 0.05``), then an SGD
step on the preconditioned gradient. Without ASDL the section quotes its figures from
shared/PERFORMANCE.md (measured on another machine).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
import types
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import curvature  # noqa: E402


def workloads():
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    yield "MLP 784-512-256-10, N=128", mlp, torch.randn(128, 784), torch.randint(0, 10, (128,))
    yield (
        "CNN 3x32x32 (12544->128), N=64",
        _cnn(),
        torch.randn(64, 3, 32, 32),
        torch.randint(0, 10, (64,)),
    )
    tok = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    yield (
        "token MLP 128-256-128, [32, 64, 128]",
        tok,
        torch.randn(32, 64, 128),
        torch.randn(32, 64, 128),
    )
    from resnets import ResNet18

    torch.manual_seed(0)
    yield (
        "ResNet-18 width 16, 1x28x28, N=128",
        ResNet18(num_classes=10, in_channels=1, width=16),
        torch.randn(128, 1, 28, 28),
        torch.randint(0, 10, (128,)),
    )
    torch.manual_seed(0)
    yield (
        "LSTM LM 1000-128-256-1000, 32 x 32 tokens",
        LSTMLanguageModel(),
        torch.randint(0, 1000, (32, 32)),
        torch.randint(0, 1000, (32, 32)),
    )


class LSTMLanguageModel(nn.Module):
    """Embedding 1000 x 128, ``nn.LSTM(128, 256)`` (395,264 parameters: Kronecker blocks
    over time, ``curvature.layers.recurrent_unrolled``), head to 1000 words; ``[N, V, T]``
    logits."""

    def __init__(self, vocab=1000, embed=128, hidden=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, embed)
        self.rnn = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))
        return self.head(out).transpose(1, 2)


def _cnn():
    # 3x32x32 -> conv(16) -> pool -> 16x16x16... -> 12544 = 64 * 14 * 14
    return nn.Sequential(
        nn.Conv2d(3, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12544, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


PERIOD = 10  # inverse_every of the curvature optimizers below


def _period(fn, device=None):
    """``PERIOD`` consecutive calls of ``fn`` as one timed call (waiting for the device)."""

    def run():
        for _ in range(PERIOD):
            fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


LR, DAMPING, FACTOR_DECAY = 1e-4, 1e-2, 0.95  # of the curvature optimizers (ours and ASDL's)

#: ASDL's figures from shared/PERFORMANCE.md (another machine), quoted when ASDL is missing
ASDL_REFERENCE = (
    "Peers' figures from shared/PERFORMANCE.md for the same workloads: "
    "KFAC step with inverses every 10 steps 6.9x / 41x / 3.1x (ASDL), an "
    "SGD step 1.2x (another machine; ASDL is not installed here, so not re-measured)."
)


def optimizers(model, loss_func):
    yield "SGD", torch.optim.SGD(model.parameters(), lr=1e-3)
    yield "Adam", torch.optim.Adam(model.parameters(), lr=LR)
    kw = dict(lr=LR, damping=DAMPING, inverse_every=PERIOD, loss_func=loss_func)
    yield "KFAC empirical", curvature.KFAC(model, fisher="empirical", **kw)
    yield "KFAC mc-1", curvature.KFAC(model, fisher="mc", **kw)
    yield "EKFAC empirical", curvature.EKFAC(model, fisher="empirical", **kw)
    yield "DiagonalNG empirical", curvature.DiagonalNaturalGradient(model, fisher="empirical", **kw)


# -- ASDL (peer) ---------------------------------------------------------------------------------
def load_asdl():
    """ASDL (``pip install asdfghjkl``, import ``asdl``) ready to run here, or ``None``.

    ASDL wraps its statistics and its refresh in ``torch.cuda.nvtx.range``, which raises
    on a CPU-only build of torch ("NVTX functions not installed"). There its module-level
    ``nvtx`` names are replaced by a no-op range: NVTX ranges are profiler annotations
    and compute nothing. Two warnings it triggers in every step are silenced.
    """
    try:
        import asdl
        from asdl.operations import operation
        from asdl.precondition import natural_gradient
    except ImportError:
        return None
    try:
        torch.cuda.nvtx.range_push("asdl")
        torch.cuda.nvtx.range_pop()
    except RuntimeError:
        shim = types.SimpleNamespace(range=lambda *args, **kwargs: contextlib.nullcontext())
        operation.nvtx = natural_gradient.nvtx = shim
    warnings.filterwarnings("ignore", "Using a non-full backward hook", FutureWarning)
    warnings.filterwarnings("ignore", ".*Consider using tensor.detach", UserWarning)
    return asdl


def asdl_fisher_runs(model, loss_func, X, y, mc_label: str = "mc-1"):
    """``(label, run)`` of ASDL's Fisher computations on ``(X, y)``, or nothing without ASDL.

    One ``FisherMaker`` per row (made once, as a user would) for the empirical and the
    MC (one sample) Kronecker factors and the empirical diagonal; each ``run()`` is a
    forward, the loss and the backward with ASDL's hooks. ``data_size`` is the loss's
    normalization (``N`` for cross-entropy, the number of entries for MSE). Labels: "ASDL
    kron empirical", "ASDL kron {mc_label}", "ASDL diag empirical".
    """
    asdl = load_asdl()
    if asdl is None:
        return
    from asdl import FisherConfig, get_fisher_maker

    ce = isinstance(loss_func, nn.CrossEntropyLoss)
    lt, size = (asdl.LOSS_CROSS_ENTROPY, y.shape[0]) if ce else (asdl.LOSS_MSE, y.numel())
    for label, ftype, shape in (
        ("ASDL kron empirical", asdl.FISHER_EMP, asdl.SHAPE_KRON),
        (f"ASDL kron {mc_label}", asdl.FISHER_MC, asdl.SHAPE_KRON),
        ("ASDL diag empirical", asdl.FISHER_EMP, asdl.SHAPE_DIAG),
    ):
        config = FisherConfig(
            fisher_type=ftype, fisher_shapes=[shape], loss_type=lt, n_mc_samples=1, data_size=size
        )
        maker = get_fisher_maker(model, config)

        def run(maker=maker):
            output = maker.setup_model_call(model, X)
            maker.setup_loss_call(loss_func, output, y)
            maker.forward_and_backward()

        yield label, run


def asdl_kfac(
    model,
    X,
    y,
    loss_func,
    fisher="empirical",
    *,
    lr=LR,
    damping=DAMPING,
    factor_decay=FACTOR_DECAY,
    period=PERIOD,
):
    """One ASDL KFAC training step on ``(X, y)``, set up like our ``curvature.KFAC`` rows.

    ``KfacGradientMaker`` (Kronecker factors, "expand" for convolutions) computes the
    statistics in every step (``curvature_upd_interval=1``; its own forward and backward,
    which also give the gradient) and the damped factor inverses every ``period`` steps
    (``preconditioner_upd_interval``; Cholesky with pi damping, ``(A + pi sqrt(lambda)
    I)`` and ``(B + sqrt(lambda)/pi I)`` with ``pi = sqrt(mean diag A / mean diag B)``,
    as our default), averages the factors by ``ema_decay = 1 - factor_decay`` (the weight
    of the new estimate) and leaves the preconditioned gradient in ``.grad``, where a
    plain SGD step uses it. ``data_size`` is the number of terms ``loss_func`` averages
    (``N`` for a cross-entropy, every element for an MSE), so that ASDL's gradient is
    that of our mean loss.

    Args:
        model (nn.Module): The model (ASDL stores its factors on the modules).
        X (Tensor): Inputs ``[N, ...]``.
        y (Tensor): Targets: class indices ``[N]`` or regression targets.
        loss_func (nn.Module): ``nn.CrossEntropyLoss()`` or ``nn.MSELoss()`` (mean).
        fisher (str): ``"empirical"`` or ``"mc"`` (one sample).
        lr (float): SGD learning rate.
        damping (float): ``lambda``.
        factor_decay (float): Weight of the old factors in their running average.
        period (int): Steps between two inverse refreshes.

    Returns:
        Callable[[], None]: The training step (zero_grad, ASDL's forward and backward
        with statistics and, every ``period`` steps, the inverses; preconditioning; SGD).

    Raises:
        ImportError: When ASDL is not installed.
        ValueError: For another ``fisher`` or loss.
    """
    asdl = load_asdl()
    if asdl is None:
        raise ImportError("ASDL is not installed: pip install asdfghjkl")
    fishers = {"empirical": asdl.FISHER_EMP, "mc": asdl.FISHER_MC}
    if fisher not in fishers:
        raise ValueError(f"fisher must be one of {sorted(fishers)}, got {fisher!r}")
    if isinstance(loss_func, nn.CrossEntropyLoss):
        loss_type, data_size = asdl.LOSS_CROSS_ENTROPY, y.shape[0]
    elif isinstance(loss_func, nn.MSELoss):
        loss_type, data_size = asdl.LOSS_MSE, y.numel()
    else:
        raise ValueError(f"loss_func must be nn.CrossEntropyLoss or nn.MSELoss, got {loss_func}")
    if loss_func.reduction != "mean":
        raise ValueError(f"loss_func must average (reduction='mean'), got {loss_func.reduction!r}")
    config = asdl.PreconditioningConfig(
        data_size=data_size,
        damping=damping,
        ema_decay=1.0 - factor_decay,
        curvature_upd_interval=1,
        preconditioner_upd_interval=period,
    )
    maker = asdl.KfacGradientMaker(
        model, config, fisher_type=fishers[fisher], loss_type=loss_type, n_mc_samples=1
    )
    sgd = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        sgd.zero_grad()
        output = maker.setup_model_call(model, X)
        maker.setup_loss_call(loss_func, output, y)
        maker.forward_and_backward()
        sgd.step()

    return step


def training_steps(model, twin, X, y, loss_func, with_asdl):
    """``(name, step, close)`` of every row: ours, and ASDL's right after our KFAC rows.

    Ours share ``model`` (one after the other; each is closed before the next is built);
    ASDL gets a fresh copy of the untouched ``twin``.
    """
    for name, opt in optimizers(model, loss_func):

        def step(opt=opt):
            opt.zero_grad()
            loss_func(model(X), y).backward()
            opt.step()

        yield name, step, getattr(opt, "close", None)
        if name == "KFAC mc-1" and with_asdl:
            for fisher, label in (("empirical", "empirical"), ("mc", "mc-1")):
                theirs = copy.deepcopy(twin)
                yield f"ASDL KFAC {label}", asdl_kfac(theirs, X, y, loss_func, fisher), None


def _load_average():
    """The 1-minute load average of the machine, or ``None`` where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def asdl_text():
    """How the ASDL rows were measured (for the generated section)."""
    version = common.package_version("asdfghjkl")
    return (
        f"ASDL (asdfghjkl {version}) is measured in the same run, the same way, right after "
        "our KFAC rows: `KfacGradientMaker` with statistics every step "
        "(`curvature_upd_interval=1`, its own forward and backward) and Cholesky inverses "
        "every 10 steps (`preconditioner_upd_interval=10`), pi damping `1e-2` as ours, "
        "`ema_decay=0.05` (our `factor_decay=0.95`), then an SGD step on the preconditioned "
        "gradient (`benchmarks/optim_step.py`, `asdl_kfac`). Its preconditioned gradient "
        "equals ours on bias-free layers (tests/test_optim_step_bench.py); it keeps the bias "
        "out of `A` and starts its factor average from zero, we put the bias in `A` and "
        "start from the first factors."
    )


def head_to_head(data):
    """Our KFAC empirical / mc-1 ratio over ASDL's, per workload (same run)."""
    lines = []
    for title, res in data.items():
        pairs = [
            f"{fisher} {res[f'KFAC {fisher}']['ratio'] / res[f'ASDL KFAC {fisher}']['ratio']:.2f}"
            for fisher in ("empirical", "mc-1")
            if f"KFAC {fisher}" in res and f"ASDL KFAC {fisher}" in res
        ]
        if pairs:
            lines.append(f"- {title}: " + ", ".join(pairs))
    if not lines:
        return ""
    return (
        "\n\nOur KFAC step over ASDL's (the two ratios above; below 1: ours is faster):\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["mlp", "cnn", "tokens"],
        help="subset of mlp, cnn, tokens, resnet18, lstm (cnn decomposes a 12545x12545 "
        "factor: minutes; resnet18, training.py's ResNet-18 with BatchNorm, and lstm, a "
        "language model with an nn.LSTM (no ASDL rows), only when named)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    repeats = 3 if args.quick else 7
    gate = common.QuietGate() if hasattr(common, "QuietGate") else (lambda: None)
    with_asdl = load_asdl() is not None
    rows, data = [], {}
    load_start = _load_average()
    start = time.perf_counter()
    keys = ["mlp", "cnn", "tokens", "resnet18", "lstm"]
    for key, (title, model, X, y) in zip(keys, workloads()):
        if key not in args.workloads:
            continue
        model, X, y = model.to(device), X.to(device), y.to(device)
        loss_func = nn.CrossEntropyLoss() if y.dtype == torch.long else nn.MSELoss()

        # the baseline runs on a copy without the optimizers' hooks
        twin = copy.deepcopy(model)

        def plain(model=twin, X=X, y=y, loss_func=loss_func):
            model.zero_grad()
            loss_func(model(X), y).backward()

        peers = with_asdl and key != "lstm"  # (ASDL has no recurrent layers)
        for name, step, close in training_steps(model, twin, X, y, loss_func, peers):
            # one measurement = one refresh period, so that every measurement holds
            # exactly one refresh (a median over shorter blocks would mostly miss it)
            res = common.compare(
                _period(plain, device),
                _period(step, device),
                repeats=repeats,
                min_time=0.0,
                gate=gate,
            )
            for k in ("time", "baseline_time"):
                res[k] /= PERIOD
            rows.append([title, name, f"{1e3 * res['time']:.1f}", f"{res['ratio']:.2f}"])
            data.setdefault(title, {})[name] = res
            print(f"{title:40s} {name:22s} {res['ratio']:6.2f}x", flush=True)
            if close is not None:
                close()
    table = common.markdown_table(["workload", "optimizer", "time [ms]", "x fwd+bwd"], rows)
    command = "python benchmarks/optim_step.py" + (" --quick" if args.quick else "")
    command += " --workloads " + " ".join(args.workloads)
    command += f" --device {args.device}" if device.type != "cpu" else ""
    body = (
        f"Generated by `benchmarks/optim_step.py`. Command: `{command}` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - start:.0f} s). "
        f"Machine: {common.machine_line()}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
        + "."
        + (
            f" Load average (1 min, other jobs included) {load_start:.1f} at the start, "
            f"{_load_average():.1f} at the end."
            if load_start is not None
            else ""
        )
        + "\n\n"
        "One full training step (zero_grad, forward, backward, optimizer step with statistics "
        "every step and decompositions every 10 steps, amortized) as a ratio to a plain "
        "forward+backward: each measurement times 10 consecutive steps (one refresh "
        "period, so exactly one refresh) against 10 plain steps; `time` is per step. "
        + (asdl_text() if with_asdl else ASDL_REFERENCE)
        + " The baseline runs on a copy of the model without the optimizers' hooks. "
        + (
            "On the CNN, the 12544->128 layer exceeds "
            "`max_factor_size=4096`: its `A` is kept as its diagonal, `G` full "
            "(`OneSidedBlock`; ASDL decomposes the full factor), so that row is not a "
            "like-for-like comparison. "
            if "cnn" in args.workloads
            else ""
        )
        + "KFAC uses its default pi damping (damped inverses "
        "by Cholesky at each refresh); EKFAC decomposes with `eigh`.\n\n"
        + table
        + (head_to_head(data) if with_asdl else "")
    )
    print(table + (head_to_head(data) if with_asdl else ""))
    if not args.no_doc:
        title = "Optimizer steps" + (f" ({device.type})" if device.type != "cpu" else "")
        common.update_doc_section("docs/benchmarks.md", title, body)
    if args.json:
        common.write_json(args.json, data)


if __name__ == "__main__":
    main()
