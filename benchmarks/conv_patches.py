"""A convolution's Kronecker statistics by either route of its patches.

    python benchmarks/conv_patches.py --layers resnet --threads 1   # training.py's ResNet-18
    python benchmarks/conv_patches.py --layers gpu --batch 64 --threads 1
    python benchmarks/conv_patches.py --device cuda                 # (not measured yet)

``"expand"``: ``sum P^T P`` and ``sum P`` of the unfolded patches ``P [N S, C_in k]``,
the patches copied channel-major (``unfold_patches``, the weight's order) against
kernel-major from a channels-last copy of the input, the product then permuted into the
weight's order (``kernel_major_sums``). ``"reduce"``: the patches summed over the output
positions, copied then summed against one GEMM per spatial axis (``patch_sums``).
The layers are those of benchmarks/conv_weight_grads.py (random inputs of their shapes);
each route is timed in the same process (median of 5 rounds of ``--reps`` calls).
``KERNEL_MAJOR_DEVICES``, ``KERNEL_MAJOR_ROWS`` and ``WINDOW_SUM_POSITIONS`` in
``curvature/layers/conv.py`` pick the routes from these figures.
"""

from __future__ import annotations

import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conv_weight_grads import LAYERS, layer_args, timed  # noqa: E402

import curvature.layers.conv as conv  # noqa: E402
from curvature.layers.precision import gram  # noqa: E402


def channel_major(layer: nn.Conv2d, x: torch.Tensor):
    P = conv.unfold_patches(layer, x).flatten(0, 2)  # [N S, C_in k]
    return gram(P.unsqueeze(0)), P.sum(0)


def main(argv=None) -> None:
    args, device = layer_args(__doc__, argv, reps=5, layers="resnet")
    kept = conv.WINDOW_SUM_POSITIONS
    print(f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("ms per call; kernel-major / channel-major, window sums / copied patches")
    try:
        for name, c_in, c_out, size, stride, pad, batch in LAYERS[args.layers]:
            N = args.batch or batch
            layer = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=pad).to(device)
            x = torch.randn(N, c_in, size, size, device=device)
            S = layer(x[:1]).shape[-2:].numel()
            D = c_in * math.prod(layer.kernel_size)
            A, s = channel_major(layer, x)
            A2, s2, _ = conv.kernel_major_sums(layer, x, True)
            err = float((A - A2).abs().max() / A.abs().max())
            t_cm = timed(lambda m=layer, x=x: channel_major(m, x), device, args.reps)
            t_km = timed(lambda m=layer, x=x: conv.kernel_major_sums(m, x, True), device, args.reps)
            t_red = {}
            for route, positions in (("copy", 10**9), ("windows", 1)):
                conv.WINDOW_SUM_POSITIONS = positions
                t_red[route] = timed(lambda m=layer, x=x: conv.patch_sums(m, x), device, args.reps)
            print(
                f"{name:34s} N={N:4d} N S / D = {N * S / D:6.2f}  expand: channel-major "
                f"{1e3 * t_cm:7.2f}  kernel-major {1e3 * t_km:7.2f} ({t_km / t_cm:.2f}x, "
                f"rel. diff {err:.1e})  reduce (S={S}): copy {1e3 * t_red['copy']:6.2f}  "
                f"windows {1e3 * t_red['windows']:6.2f} ({t_red['windows'] / t_red['copy']:.2f}x)",
                flush=True,
            )
    finally:
        conv.WINDOW_SUM_POSITIONS = kept


if __name__ == "__main__":
    main()
