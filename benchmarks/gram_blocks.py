"""Gram matrices ``x^T x`` on a CPU: one GEMM against the lower block triangle.

    python benchmarks/gram_blocks.py [--threads 1,2] [--blocks 2,3,4]

The Kronecker statistics are Gram matrices of layer inputs ``[M, D]`` (``M`` rows: samples
times positions) and output gradients; a CPU's GEMM computes all ``D^2`` entries although
the result is symmetric. ``curvature.layers.precision.triangle_gram`` takes the block rows
of the lower triangle only (``(k + 1) / (2 k)`` of the work for ``k`` blocks) and mirrors
the rest. Shapes: the Fashion-MNIST MLP's input factor ([256, 785]), the optimizer
benchmark MLP's ([128, 785]), convolution patches (ResNet / VGG-like: [6272, 144],
[2048, 288], [512, 576]), the GPU benchmark MLP's on a CPU ([1024, 2049]) and small ones.
Prints the first-quartile time of 25 calls per variant (ms); ``gram`` is the library's
choice (the triangle above ``TRIANGLE_GRAM_WORK``, the plain GEMM below).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import quantile_ms  # noqa: E402

from curvature.layers.precision import gram, triangle_gram  # noqa: E402

SHAPES = [
    (256, 785),
    (128, 785),
    (6272, 144),
    (2048, 288),
    (512, 576),
    (1024, 2049),
    (1152, 1152),
    (128, 577),
    (256, 257),
    (4096, 64),
]


def quartile(fn) -> float:
    return quantile_ms(fn, repeats=25, q=0.25, warmup=3)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--blocks", default="2,3,4")
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        names = ["one GEMM"] + [f"{b} blocks" for b in blocks] + ["gram()"]
        print(f"{threads} thread(s): M D | " + " | ".join(names))
        for M, D in SHAPES:
            x = torch.randn(M, D)
            full = x.T @ x
            for b in blocks:  # the same matrix up to rounding, exactly symmetric
                tri = triangle_gram(x, b)
                assert torch.allclose(tri, full, rtol=1e-4, atol=1e-3) and torch.equal(tri, tri.T)
            row = [quartile(lambda x=x: torch.bmm(x.T[None], x[None]))]
            row += [quartile(lambda x=x, b=b: triangle_gram(x, b)) for b in blocks]
            row.append(quartile(lambda x=x: gram(x[None])))
            print(f"  {M} {D} | " + " | ".join(f"{v:.3f}" for v in row))


if __name__ == "__main__":
    main()
