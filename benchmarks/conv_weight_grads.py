"""Per-sample weight gradients of convolutions: one grouped convolution backward against
batched GEMMs over unfolded patches (``curvature.layers.conv.patch_weight_grads``).

    python benchmarks/conv_weight_grads.py --device cuda           # the GPU's choice
    python benchmarks/conv_weight_grads.py --device cpu --batch 64  # the CPU's choice

The layers are those of benchmarks/gpu.py's CNNs (the 12544-input CNN's two
convolutions, the VGG-like CNN's six), on random inputs and output gradients of their
shapes; each path is timed in the same process (median of 5 rounds of ``--reps``
calls, ended by a synchronization on a GPU). ``PATCH_GEMM_DEVICES`` and
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

LAYERS = [  # name, C_in, C_out, spatial size, padding, batch at full size
    ("CNN conv 3->32, 32x32", 3, 32, 32, 0, 512),
    ("CNN conv 32->64, 30x30", 32, 64, 30, 0, 512),
    ("VGG conv 3->64, 32x32", 3, 64, 32, 1, 256),
    ("VGG conv 64->64, 32x32", 64, 64, 32, 1, 256),
    ("VGG conv 64->128, 16x16", 64, 128, 16, 1, 256),
    ("VGG conv 128->128, 16x16", 128, 128, 16, 1, 256),
    ("VGG conv 128->256, 8x8", 128, 256, 8, 1, 256),
    ("VGG conv 256->256, 8x8", 256, 256, 8, 1, 256),
]


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="override the batch sizes")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    kept = conv.PATCH_GEMM_DEVICES, conv.PATCH_GEMM_POSITIONS
    print(f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    try:
        for name, c_in, c_out, size, pad, batch in LAYERS:
            N = args.batch or batch
            layer = nn.Conv2d(c_in, c_out, 3, padding=pad).to(device)
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
            print(
                f"{name:26s} N={N:4d}  grouped conv {1e3 * times['grouped']:8.3f} ms  "
                f"patch GEMMs {1e3 * times['patches']:8.3f} ms  "
                f"({times['grouped'] / times['patches']:.2f}x)  rel. diff {float(err):.1e}",
                flush=True,
            )
    finally:
        conv.PATCH_GEMM_DEVICES, conv.PATCH_GEMM_POSITIONS = kept


if __name__ == "__main__":
    main()
