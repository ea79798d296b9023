"""Per-sample weight gradients of convolutions: one grouped convolution backward against
batched GEMMs over unfolded patches (``curvature.layers.conv.patch_weight_grads``).

    python benchmarks/conv_weight_grads.py --device cuda           # the GPU's choice
    python benchmarks/conv_weight_grads.py --device cpu --batch 32 --reps 3
    python benchmarks/conv_weight_grads.py --device cpu --layers resnet --threads 1

The layers (``--layers``) are those of benchmarks/gpu.py's CNNs (``gpu``: the
12544-input CNN's two convolutions, the VGG-like CNN's six) or of training.py's ResNet-18
at width 16 (``resnet``), on random inputs and output gradients of their shapes; each
path is timed in the same process (median of 5 rounds of ``--reps`` calls, ended by a
synchronization on a GPU). ``PATCH_GEMM_DEVICES`` and
``PATCH_GEMM_POSITIONS`` in ``curvature/layers/conv.py`` pick the path from these
figures (always the patch GEMMs on CUDA; on a CPU where a sample has few output
positions per input channel).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import curvature.layers.conv as conv

LAYERS = {  # name, C_in, C_out, input size, stride, padding, batch at full size
    "gpu": [  # benchmarks/gpu.py's CNNs
        ("CNN conv 3->32, 32x32", 3, 32, 32, 1, 0, 512),
        ("CNN conv 32->64, 30x30", 32, 64, 30, 1, 0, 512),
        ("VGG conv 3->64, 32x32", 3, 64, 32, 1, 1, 256),
        ("VGG conv 64->64, 32x32", 64, 64, 32, 1, 1, 256),
        ("VGG conv 64->128, 16x16", 64, 128, 16, 1, 1, 256),
        ("VGG conv 128->128, 16x16", 128, 128, 16, 1, 1, 256),
        ("VGG conv 128->256, 8x8", 128, 256, 8, 1, 1, 256),
        ("VGG conv 256->256, 8x8", 256, 256, 8, 1, 1, 256),
    ],
    "resnet": [  # training.py's ResNet-18 at width 16 on 28x28 images (3x3 convolutions)
        ("ResNet conv 16->16, 7x7", 16, 16, 7, 1, 1, 128),
        ("ResNet conv 16->32, 7x7, stride 2", 16, 32, 7, 2, 1, 128),
        ("ResNet conv 32->32, 4x4", 32, 32, 4, 1, 1, 128),
        ("ResNet conv 32->64, 4x4, stride 2", 32, 64, 4, 2, 1, 128),
        ("ResNet conv 64->64, 2x2", 64, 64, 2, 1, 1, 128),
        ("ResNet conv 64->128, 2x2, stride 2", 64, 128, 2, 2, 1, 128),
        ("ResNet conv 128->128, 1x1", 128, 128, 1, 1, 1, 128),
    ],
}


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call over 5 rounds of ``reps`` calls (after one warm-up call)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - start) / reps)
    return sorted(times)[2]


def layer_args(doc: str, argv=None, reps: int = 10, layers: str = "gpu"):
    """``(args, device)``: the command line of a script over :data:`LAYERS` (``--device``,
    ``--batch``, ``--reps``, ``--layers``, ``--threads``), threads set, TF32 off, seeded.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="override the batch sizes")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--layers", choices=sorted(LAYERS), default=layers)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    return args, torch.device(args.device)


def main(argv=None) -> None:
    args, device = layer_args(__doc__, argv)
    kept = conv.PATCH_GEMM_DEVICES, conv.PATCH_GEMM_POSITIONS
    print(f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    try:
        for name, c_in, c_out, size, stride, pad, batch in LAYERS[args.layers]:
            N = args.batch or batch
            layer = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=pad).to(device)
            x = torch.randn(N, c_in, size, size, device=device)
            with torch.no_grad():
                g = torch.randn_like(layer(x))
            res, times = {}, {}
            for path, devices in (("grouped", ()), ("patches", (device.type,))):
                conv.PATCH_GEMM_DEVICES, conv.PATCH_GEMM_POSITIONS = devices, 0
                res[path] = conv.per_sample_weight_grads(layer, x, g)
                times[path] = timed(
                    lambda m=layer, x=x, g=g: conv.per_sample_weight_grads(m, x, g),
                    device,
                    args.reps,
                )
            err = (res["grouped"] - res["patches"]).abs().max() / res["grouped"].abs().max()
            positions = g.shape[-2:].numel() / c_in  # output positions per input channel
            print(
                f"{name:34s} N={N:4d} S/C_in={positions:5.2f}  "
                f"grouped conv {1e3 * times['grouped']:8.3f} ms  "
                f"patch GEMMs {1e3 * times['patches']:8.3f} ms  "
                f"({times['grouped'] / times['patches']:.2f}x)  rel. diff {float(err):.1e}",
                flush=True,
            )
    finally:
        conv.PATCH_GEMM_DEVICES, conv.PATCH_GEMM_POSITIONS = kept


if __name__ == "__main__":
    main()
