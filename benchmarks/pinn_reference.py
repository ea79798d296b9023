"""A dense reimplementation of KFAC for PINNs on the example's 2d Poisson problem.

Independent of ``curvature.KFAC``: the 2-64-1 tanh network of ``examples/pinn_poisson.py``
(the same points, initialization and loss ``1/2 mean r^2 + 1/2 mean (u - g)^2``) written
out by hand with its forward Laplacian, the Kronecker factors of Dangel, Mueller &
Zeinhofer (2024) (KFAC-expand over the value, derivative and Laplacian slots: ``A = 1/(N S)
sum a a^T``, ``G = 1/N sum g g^T``, per term), the damped Kronecker sum of the interior and
boundary terms solved as a dense ``[D_out D, D_out D]`` system, and the learning rate and
momentum from the 2x2 quadratic model with the exact Gauss-Newton matrix (Martens & Grosse
2015, section 7). The exact Gauss-Newton matrix (257 parameters) is formed from the
per-sample Jacobians, so ``--direction exact`` replaces the Kronecker-factored direction by
the exact damped Gauss-Newton one (the ceiling of the update rule); ``blocks``: its
two per-layer blocks; ``first``: the first layer's exact block (``[192, 192]``), the
output layer's direction Kronecker-factored.

Two rules:

* ``--rule library`` (default): the example's defaults: factors from the first step on
  (no bias), decay 0.45, ``lambda`` from 1e-2 by Levenberg-Marquardt (0.95) every step, a
  step that more than doubles the loss rejected (``lambda`` grows by ``0.95^(-2^(k-1))``);
  the first step from the 1x1 model.
* ``--rule paper``: the paper's KFAC* (its code's ``lr="auto"``): factors initialized to the
  identity, decay 0.926, fixed ``lambda`` 1.2e-10, first step ``1e-6`` times the
  direction, no rejection.

    OMP_NUM_THREADS=1 python benchmarks/pinn_reference.py --seed 0 --steps 1000
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Dict, List, Tuple

import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Factors = Dict[str, List[Tuple[Tensor, Tensor]]]


def example():
    """examples/pinn_poisson.py as a module."""
    spec = importlib.util.spec_from_file_location(
        "pinn_poisson", os.path.join(ROOT, "examples", "pinn_poisson.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Problem:
    """The 2-64-1 network as a function of its flat parameters ``[257]``."""

    def __init__(self, seed: int):
        ex = example()
        gen = torch.Generator().manual_seed(seed)
        self.x_int, self.x_bnd, self.g_bnd, self.x_eval, self.solution, _ = ex.poisson(
            gen, 900, 120, 9000
        )
        torch.manual_seed(seed)
        params = [p.detach().clone() for p in ex.make_model(2, (64,)).parameters()]
        self.shapes = [p.shape for p in params]
        self.theta0 = torch.cat([p.reshape(-1) for p in params])
        self.pi = ex.PI

    def unflat(self, th: Tensor) -> List[Tensor]:
        out, i = [], 0
        for s in self.shapes:
            out.append(th[i : i + s.numel()].view(s))
            i += s.numel()
        return out

    def interior(self, th: Tensor, keep: bool = False):
        """Residual ``[N]``; ``keep``: also the layer inputs ``[N, 4, D]`` and layer 1's
        outputs (slots value, d/dx, d/dy, Laplacian; bias coordinate on the value slot).
        """
        W1, b1, W2, b2 = self.unflat(th)
        x = self.x_int
        N = x.shape[0]
        a1 = torch.zeros(N, 4, 3, dtype=th.dtype)
        a1[:, 0, :2], a1[:, 0, 2], a1[:, 1, 0], a1[:, 2, 1] = x, 1, 1, 1
        z1 = a1 @ torch.cat([W1, b1[:, None]], 1).T  # [N, 4, 64]
        if keep:
            z1 = z1.detach().requires_grad_(True)
        t = torch.tanh(z1[:, 0])
        d1 = 1 - t**2
        a2 = torch.zeros(N, 4, 65, dtype=th.dtype)
        a2[:, 0, :64], a2[:, 0, 64] = t, 1
        a2[:, 1:3, :64] = d1[:, None] * z1[:, 1:3]
        a2[:, 3, :64] = -2 * t * d1 * (z1[:, 1:3] ** 2).sum(1) + d1 * z1[:, 3]
        z2 = a2 @ torch.cat([W2, b2[:, None]], 1).T  # [N, 4, 1]
        f = 2 * self.pi**2 * torch.sin(self.pi * x[:, 0]) * torch.sin(self.pi * x[:, 1])
        r = z2[:, 3, 0] + f
        return (r, a1, z1, a2.detach()) if keep else r

    def boundary(self, th: Tensor, keep: bool = False):
        W1, b1, W2, b2 = self.unflat(th)
        ones = torch.ones(self.x_bnd.shape[0], 1, dtype=th.dtype)
        a1 = torch.cat([self.x_bnd, ones], 1)
        z1 = a1 @ torch.cat([W1, b1[:, None]], 1).T
        if keep:
            z1 = z1.detach().requires_grad_(True)
        a2 = torch.cat([torch.tanh(z1), ones], 1)
        r = (a2 @ torch.cat([W2, b2[:, None]], 1).T)[:, 0] - self.g_bnd
        return (r, a1[:, None], z1, a2[:, None].detach()) if keep else r

    def loss(self, th: Tensor) -> Tensor:
        return 0.5 * self.interior(th).pow(2).mean() + 0.5 * self.boundary(th).pow(2).mean()

    def l2(self, th: Tensor) -> float:
        W1, b1, W2, b2 = self.unflat(th)
        u = torch.tanh(self.x_eval @ W1.T + b1) @ W2.T + b2
        return float((u[:, 0] - self.solution(self.x_eval)).pow(2).mean().sqrt())

    def statistics(self, th: Tensor):
        """Per term: layer inputs ``a`` and residual gradients ``g`` at the layer outputs."""
        out = {}
        for term, fn in (("int", self.interior), ("bnd", self.boundary)):
            r, a1, z1, a2 = fn(th, keep=True)
            (g1,) = torch.autograd.grad(r.sum(), z1)
            g1 = g1 if g1.dim() == 3 else g1[:, None]
            g2 = torch.zeros(a2.shape[0], a2.shape[1], 1, dtype=th.dtype)
            g2[:, -1] = 1  # the residual is the output's Laplacian slot (boundary: its value)
            out[term] = [(a1, g1), (a2, g2)]
        return out

    def factors(self, stats) -> Factors:
        """KFAC-expand: ``A = 1/(N S) sum a a^T``, ``G = 1/N sum g g^T`` per term and layer."""
        return {
            term: [
                (
                    torch.einsum("nsi,nsj->ij", a, a) / (a.shape[0] * a.shape[1]),
                    torch.einsum("nsi,nsj->ij", g, g) / a.shape[0],
                )
                for a, g in layers
            ]
            for term, layers in stats.items()
        }

    def jacobian(self, stats) -> Tensor:
        """``[N + M, 257]``: the residuals' Jacobians, each term scaled by ``1/sqrt(N)``."""
        rows = []
        for layers in stats.values():
            parts = []
            for a, g in layers:
                J = torch.einsum("nso,nsi->noi", g, a)  # [N, D_out, D + 1]
                parts += [J[:, :, :-1].reshape(J.shape[0], -1), J[:, :, -1]]
            rows.append(torch.cat(parts, 1) / layers[0][0].shape[0] ** 0.5)
        return torch.cat(rows)

    def precondition(self, F: Factors, grad: Tensor, lam: float) -> Tensor:
        """``[(A1 + lam) x (G1 + lam) + (A2 + lam) x (G2 + lam)]^{-1} grad`` per layer."""
        W1, b1, W2, b2 = self.unflat(grad)
        out = []
        for layer, (W, b) in enumerate(((W1, b1), (W2, b2))):
            M = torch.cat([W, b[:, None]], 1)  # [D_out, D + 1], rows: kron(G, A)
            K = sum(
                torch.kron(
                    G + lam * torch.eye(G.shape[0], dtype=G.dtype),
                    A + lam * torch.eye(A.shape[0], dtype=A.dtype),
                )
                for A, G in (F["int"][layer], F["bnd"][layer])
            )
            d = torch.linalg.solve(K, M.reshape(-1)).view_as(M)
            out += [d[:, :-1].reshape(-1), d[:, -1]]
        return torch.cat(out)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--rule", choices=["library", "paper"], default="library")
    parser.add_argument(
        "--direction",
        choices=["kfac", "exact", "blocks", "first"],
        default="kfac",
        help="exact: the damped Gauss-Newton matrix; blocks: its per-layer blocks; first: "
        "the first layer's exact block, the output layer Kronecker-factored",
    )
    parser.add_argument("--damping", type=float, default=None)
    parser.add_argument("--factor-decay", type=float, default=None)
    parser.add_argument("--adaptation-decay", type=float, default=0.95, help="library rule")
    args = parser.parse_args(argv)
    paper = args.rule == "paper"
    decay = args.factor_decay if args.factor_decay is not None else (0.926 if paper else 0.45)
    lam = args.damping if args.damping is not None else (1.2156e-10 if paper else 1e-2)
    omega = args.adaptation_decay
    prob = Problem(args.seed)
    theta = prob.theta0.double()
    F, previous, streak = None, None, 0
    start = time.process_time()
    for step in range(args.steps + 1):
        if step % args.log_every == 0 or step == args.steps:
            print(
                f"step {step:5d}  loss {float(prob.loss(theta)):.3e}  L2 {prob.l2(theta):.3e}  "
                f"lambda {lam:.2e}  cpu {time.process_time() - start:.1f} s",
                flush=True,
            )
        if step == args.steps:
            break
        th = theta.clone().requires_grad_(True)
        loss = prob.loss(th)
        (grad,) = torch.autograd.grad(loss, th)
        loss = loss.detach()
        stats = prob.statistics(theta)
        new = prob.factors(stats)
        if F is None:  # paper: an EMA from the identity; library: the first factors as they are
            eye = {
                t: [(torch.eye(len(A)), torch.eye(len(G))) for A, G in v] for t, v in new.items()
            }
            F = eye if paper else new
        if F is not new:
            F = {
                t: [
                    (decay * A0 + (1 - decay) * A, decay * G0 + (1 - decay) * G)
                    for (A0, G0), (A, G) in zip(F[t], new[t])
                ]
                for t in new
            }
        J = prob.jacobian(stats)
        if args.direction == "kfac":
            direction = -prob.precondition(F, grad, lam)
        else:  # exact blocks (+ lambda I): the whole matrix, per layer, or the first layer
            spans = {"exact": [slice(0, 257)], "blocks": [slice(0, 192), slice(192, 257)]}
            spans["first"] = spans["blocks"][:1]
            direction = -prob.precondition(F, grad, lam)
            for span in spans[args.direction]:
                C = J[:, span].T @ J[:, span]
                eye = torch.eye(len(C), dtype=C.dtype)
                direction[span] = -torch.linalg.solve(C + lam * eye, grad[span])
        if paper and step == 0:
            update, model = 1e-6 * direction, None
        else:
            V = torch.stack([direction] if previous is None else [direction, previous])
            JV = J @ V.T
            system = JV.T @ JV + lam * V @ V.T
            linear = V @ grad
            c = -torch.linalg.solve(system, linear)
            update, model = c @ V, float(0.5 * c @ system @ c + linear @ c)
        after = float(prob.loss(theta + update))
        if not paper and model is not None:  # Levenberg-Marquardt, rejection of blow-ups
            if after > 2 * float(loss):
                streak += 1
                lam /= omega ** (2 ** (streak - 1))
                previous = None
                continue
            streak = 0
            rho = (after - float(loss)) / model
            lam *= omega if rho > 0.75 else (1 / omega if rho < 0.25 else 1.0)
        theta, previous = theta + update, update
    return prob.l2(theta)


if __name__ == "__main__":
    main()
