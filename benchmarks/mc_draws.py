"""The cost of the MC Fisher's random draws on a CPU, and of the steps that make them.

    python benchmarks/mc_draws.py [--threads 2] [--repeats 5]

Prints (median of ``--repeats``, milliseconds): the draws themselves (2.1M normals in
float32 and float64; labels from ``[2048, 8192]`` float64 weights by ``torch.multinomial``
and by the inverse CDF that ``curvature.losses`` uses on a CPU), then KFAC's step with
``fisher="empirical"`` and ``"mc"`` on a small language model with a large vocabulary
(benchmarks/gpu.py's ``LM``: vocabulary 8192, d=64, 2 layers, T=64, N=16) and
``curvature.kfac(fisher="mc")`` on the token MLP (``[256, 64, 128]`` outputs, MSE) as a
multiple of a forward+backward. To compare two versions of the package, run it with
each on the path (``PYTHONPATH=<tree>``), alternating. No figures are written to the docs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import gpu  # noqa: E402

import curvature  # noqa: E402


def ms(fn, repeats: int, inner: int = 1) -> float:
    """Milliseconds per call: the median of ``repeats`` timings of ``inner`` calls."""
    fn()
    return statistics.median(common._time(fn, inner) for _ in range(repeats)) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    r = args.repeats
    print(f"curvature from {os.path.dirname(curvature.__file__)}, {args.threads} thread(s)")
    for dtype in (torch.float32, torch.float64):
        t = ms(lambda dtype=dtype: torch.randn(256 * 64 * 128, dtype=dtype, generator=g), r)
        print(f"2.1M normals, {dtype}: {t:.1f} ms")
    p = torch.randn(2048, 8192, generator=g).softmax(-1).double()
    t = ms(lambda: torch.multinomial(p, 1, generator=g), r)
    print(f"labels of [2048, 8192] float64 weights, torch.multinomial: {t:.1f} ms")

    def inverse_cdf():
        cdf = p.cumsum(-1)
        u = torch.rand(2048, 1, generator=g, dtype=torch.float64).mul_(cdf[:, -1:])
        return torch.searchsorted(cdf, u, right=True)

    print(f"labels of [2048, 8192] float64 weights, inverse CDF: {ms(inverse_cdf, r):.1f} ms")

    V, T, N = 8192, 64, 16
    tokens = torch.randint(0, V, (N, T + 1), generator=g)
    X, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    ce = nn.CrossEntropyLoss()
    for fisher in ("empirical", "mc"):
        torch.manual_seed(0)
        model = gpu.LM(V, 64, 2, heads=2, context=T)
        opt = curvature.KFAC(model, lr=1e-3, damping=1e-2, fisher=fisher, loss_func=ce)

        def step(model=model, opt=opt):
            opt.zero_grad()
            ce(model(X), y).backward()
            opt.step()

        for _ in range(3):
            step()
        print(f"KFAC {fisher} step, LM V={V} d=64 T={T} N={N}: {ms(step, r, 5):.1f} ms")
        opt.close()

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    Xt, yt = torch.randn(256, 64, 128, generator=g), torch.randn(256, 64, 128, generator=g)
    mse = nn.MSELoss()

    def plain():
        mlp.zero_grad()
        mse(mlp(Xt), yt).backward()

    base = ms(plain, 2 * r + 1)
    t = ms(lambda: curvature.kfac(mlp, mse, (Xt, yt), fisher="mc"), 2 * r + 1)
    print(f"kfac(fisher='mc'), token MLP [256, 64, 128], MSE: {t / base:.2f}x a forward+backward")


if __name__ == "__main__":
    main()
