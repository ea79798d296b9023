"""The demo's data: scikit-learn's bundled digits and Fashion-MNIST from IDX files.

Used by :mod:`curvature.demo`; tensors come flattened and scaled to ``[0, 1]``.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
from torch import Tensor

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
EXTRA = "pip install 'torch-curvature[examples]'"


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
