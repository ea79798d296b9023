"""Exact-vs-approximate Fisher studies: how far is each approximation from the GGN.

:func:`compare_approximations` builds the exact GGN of a (small) model on data and a set
of approximations of it, and reports per layer and overall:

- the relative Frobenius error ``|B - GGN|_F / |GGN|_F`` (per layer on the layer's
  diagonal block; overall against the full GGN, off-diagonal blocks included),
- the cosine between the damped natural-gradient directions
  ``(B + lambda I)^{-1} grad`` and ``(GGN + lambda I)^{-1} grad``,
- the top eigenvalues of each matrix.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor, nn

from .capture import isolated
from .dense import Data, batches, empirical_fisher, ggn
from .kfac import diag_ggn, ekfac, kfac
from .layout import ParamLayout
from .linalg import damped_solve, top_eigenvalues

DEFAULT_APPROXIMATIONS = (
    "kfac",
    "kfac-reduce",
    "ekfac",
    "ef-kfac",
    "mc-kfac-1",
    "diag-ggn",
    "diag-ef",
    "ef",
)


def _builders(model, loss_func, data, seed) -> Dict[str, Callable[[], Tensor]]:
    layout = ParamLayout.of(model)

    def diag(d: Dict[str, Tensor]) -> Tensor:
        return torch.diag(layout.flatten(d, what="diag_ggn"))

    def k(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kfac(model, loss_func, data, seed=seed, **kw).to_dense()

    def ek(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ekfac(model, loss_func, data, seed=seed, **kw).to_dense()

    return {
        "kfac": lambda: k(),
        "kfac-reduce": lambda: k(kfac_approx="reduce"),
        "ekfac": lambda: ek(),
        "ef-kfac": lambda: k(fisher="empirical"),
        "diag-ggn": lambda: diag(diag_ggn(model, loss_func, data)),
        "diag-ef": lambda: diag(diag_ggn(model, loss_func, data, fisher="empirical")),
        "ef": lambda: empirical_fisher(model, loss_func, data),
    }


def _build(name: str, builders, model, loss_func, data, seed) -> Tensor:
    if name in builders:
        return builders[name]()
    if name.startswith("mc-kfac-"):
        M = int(name.rsplit("-", 1)[1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kfac(model, loss_func, data, fisher="mc", mc_samples=M, seed=seed).to_dense()
    if name.startswith("rademacher-kfac-"):
        M = int(name.rsplit("-", 1)[1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kfac(
                model, loss_func, data, fisher="rademacher", mc_samples=M, seed=seed
            ).to_dense()
    raise ValueError(
        f"unknown approximation {name!r}; use one of {sorted(builders)} or 'mc-kfac-<k>', "
        "'rademacher-kfac-<k>'."
    )


@dataclass
class StudyResult:
    """Errors of each approximation against the exact GGN.

    Attributes:
        layers: Layer names (modules owning trainable parameters).
        rel_error: ``approx -> layer -> relative Frobenius error`` (key ``"overall"`` too).
        cosine: ``approx -> cosine`` of damped natural-gradient directions with the GGN's.
        top_eigenvalues: ``name -> [top_k]`` (``"ggn"`` included).
        damping: The damping used for the directions.

    """

    layers: List[str]
    rel_error: Dict[str, Dict[str, float]]
    cosine: Dict[str, float]
    top_eigenvalues: Dict[str, List[float]]
    damping: float
    matrices: Dict[str, Tensor] = field(default_factory=dict, repr=False)

    def table(self) -> str:
        """A Markdown table: one row per approximation."""
        cols = ["overall", *self.layers]
        head = "| approximation | " + " | ".join(f"rel. err {c}" for c in cols)
        head += f" | cos(dir), lambda={self.damping:g} | top eigenvalue |"
        lines = [head, "|" + " --- |" * (len(cols) + 3)]
        for name, errs in self.rel_error.items():
            row = " | ".join(f"{errs[c]:.3f}" for c in cols)
            top = self.top_eigenvalues[name][0] if self.top_eigenvalues[name] else math.nan
            lines.append(f"| {name} | {row} | {self.cosine[name]:.4f} | {top:.4g} |")
        ggn_top = self.top_eigenvalues["ggn"][0]
        lines.append("| ggn (exact) |" + " 0 |" * len(cols) + f" 1 | {ggn_top:.4g} |")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Save a figure (relative errors per layer, direction cosines); needs matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(self.rel_error)
        cols = ["overall", *self.layers]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            ax1.bar(
                [i + j * width for i in range(len(names))],
                [self.rel_error[n][c] for n in names],
                width,
                label=c,
            )
        ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45)
        ax1.set_ylabel("relative Frobenius error vs GGN")
        ax1.legend(fontsize=7)
        ax2.bar(names, [self.cosine[n] for n in names])
        ax2.set_ylabel(f"cosine of damped NG direction (lambda={self.damping:g})")
        ax2.set_ylim(min(0.0, min(self.cosine.values())), 1.0)
        ax2.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _layer_groups(layout: ParamLayout) -> Dict[str, Tensor]:
    """Layer (owning module) name to the flat indices ``[P_l]`` of its parameters."""
    groups: Dict[str, List[str]] = {}
    for n in layout.names:
        groups.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(n)
    return {k: layout.index(names) for k, names in groups.items()}


def _gradient(layout: ParamLayout, model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The gradient ``[P]`` of the loss over the union of the batches."""
    bs = batches(data)
    total = None
    N = sum(X.shape[0] for X, _ in bs)
    for X, y in bs:
        w = X.shape[0] / N if loss_func.reduction == "mean" else 1.0
        with isolated():  # not a training forward of an attached optimizer
            gs = torch.autograd.grad(loss_func(model(X), y), layout.params)
        flat = w * layout.flatten(gs, what="the gradient")
        total = flat if total is None else total + flat
    return total.detach()


def compare_approximations(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    approximations: Sequence[str] = DEFAULT_APPROXIMATIONS,
    *,
    damping: float = 1e-3,
    top_k: int = 5,
    seed: int = 0,
    keep_matrices: bool = False,
) -> StudyResult:
    """Compare curvature approximations with the exact GGN (dense; small models only).

    Args:
        model: The model (a dense ``[P, P]`` GGN must fit in memory).
        loss_func: A supported loss module.
        data: ``(X, y)`` or an iterable of batches.
        approximations: Names among ``"kfac"``, ``"kfac-reduce"``, ``"ekfac"``,
            ``"ef-kfac"``, ``"mc-kfac-<k>"``, ``"rademacher-kfac-<k>"``, ``"diag-ggn"``,
            ``"diag-ef"``, ``"ef"`` (the dense empirical Fisher).
        damping: ``lambda`` for the natural-gradient directions.
        top_k: Number of top eigenvalues reported.
        seed: Seed for the stochastic approximations.
        keep_matrices: Keep the dense matrices in the result.

    Returns:
        A :class:`StudyResult` (``.table()`` for Markdown, ``.plot(path)`` for a figure).

    """
    if damping <= 0:
        raise ValueError(f"damping={damping} must be > 0.")
    G = ggn(model, loss_func, data)
    layout = ParamLayout.of(model)
    grad = _gradient(layout, model, loss_func, data).to(G)
    d_exact = damped_solve(G, damping, grad)
    groups = _layer_groups(layout)
    builders = _builders(model, loss_func, data, seed)
    rel: Dict[str, Dict[str, float]] = {}
    cos: Dict[str, float] = {}
    tops: Dict[str, List[float]] = {"ggn": top_eigenvalues(G, top_k)}
    mats: Dict[str, Tensor] = {"ggn": G} if keep_matrices else {}
    for name in approximations:
        B = _build(name, builders, model, loss_func, data, seed).to(G)
        errs = {"overall": float((B - G).norm() / G.norm().clamp_min(1e-300))}
        for layer, ix in groups.items():
            Gb = G[ix][:, ix]
            errs[layer] = float((B[ix][:, ix] - Gb).norm() / Gb.norm().clamp_min(1e-300))
        rel[name] = errs
        d = damped_solve(B, damping, grad)
        cos[name] = float(d @ d_exact / (d.norm() * d_exact.norm()).clamp_min(1e-300))
        tops[name] = top_eigenvalues(B, top_k)
        if keep_matrices:
            mats[name] = B
    return StudyResult(list(groups), rel, cos, tops, damping, mats)
