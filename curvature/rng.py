"""Sampling generators: one per device, seeded from one seed (the optimizers', ``kfac()``'s).

MC labels and Rademacher signs are drawn on the device of the output they belong to, so
nothing is copied to the host to sample. The CPU generator is the optimizer's
``generator`` (its draws are those of earlier versions on CPU); a generator for another
device is created at its first draw, seeded with the CPU generator's seed of the
moment. Every generator's state is saved in the optimizer's ``state_dict``, so a
resumed run draws the same numbers. :func:`probe_matrix` is a fixed generic matrix made
on any device without a generator.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor


class SamplingGenerators:
    """``torch.Generator`` per device; :meth:`on` is what the losses draw from.

    Attributes:
        cpu: The CPU generator (the optimizer's ``generator``).
        devices: Device name (``"cuda:0"``) to its generator, created on first use.

    """

    def __init__(self, cpu: torch.Generator):
        self.cpu = cpu
        self.devices: Dict[str, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        """The generator of ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.cpu
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self.devices:
            self.devices[key] = torch.Generator(device=device).manual_seed(self.cpu.initial_seed())
        return self.devices[key]

    def manual_seed(self, seed: int) -> None:
        """Seed every generator with ``seed``."""
        self.cpu.manual_seed(seed)
        for g in self.devices.values():
            g.manual_seed(seed)

    def get_state(self) -> Dict[str, Any]:
        """Every generator's state, by device name (``"cpu"`` included)."""
        return {"cpu": self.cpu.get_state(), **{k: g.get_state() for k, g in self.devices.items()}}

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`get_state` (a device's generator is created if needed)."""
        for key, value in state.items():
            self.on(torch.device(key)).set_state(value)
        for key in list(self.devices):
            if key not in state:  # created after the state was taken: as if never used
                del self.devices[key]

    def device_states(self) -> Dict[str, Any]:
        """The states of the non-CPU generators (saved next to the CPU one)."""
        return {k: g.get_state() for k, g in self.devices.items()}


#: The modulus of :func:`probe_matrix`'s integer hash (the Mersenne prime ``2^31 - 1``).
_PROBE_MODULUS = 2**31 - 1

#: Entries of :func:`probe_matrix` made at a time by :func:`probe_product` (its integer
#: temporaries: 2 MiB each at int64).
PROBE_SLICE = 2**18


def probe_matrix(
    n: int,
    k: int,
    device: torch.device,
    dtype: torch.dtype,
    rows: Optional[Tuple[int, int]] = None,
) -> Tensor:
    """``[n, k]`` a fixed generic matrix, entries in ``(-1, 1)``, made on ``device``
    (``rows``: ``(start, stop)``, only those rows of it).

    Entry ``(i, j)`` is an integer hash of ``i k + j`` (xor-shifts and multiplications
    modulo ``2^31 - 1``, every product below ``2^47``): exact integer arithmetic, so the
    same matrix on every device and in every process, and no host-to-device copy (a
    draw from a seeded CPU generator moved to a GPU would synchronize the host there).
    Its role is a random matrix's: ``Q_k^T R`` has full rank for any orthonormal ``Q_k``
    off a set of measure zero.
    """
    m = _PROBE_MODULUS
    start, stop = rows or (0, n)
    x = torch.arange(start * k + 1, stop * k + 1, device=device, dtype=torch.int64)
    x = x.view(stop - start, k)
    for shift in (13, 7, 17):
        x = torch.bitwise_xor(x, x >> shift).mul_(48271).remainder_(m)
    calc = dtype if dtype in (torch.float32, torch.float64) else torch.float32  # (MPS: no f64)
    return (x.to(calc) * (2.0 / m) - 1.0).to(dtype)


def probe_product(Q: Tensor) -> Tensor:
    """``Q^T R`` of ``Q [n, k]`` and ``R = probe_matrix(n, k)`` (``[k, k]``, ``Q``'s dtype),
    ``R`` made a slice of rows at a time (:data:`PROBE_SLICE` entries): neither all of
    ``R`` nor its integer temporaries are ever in memory (a factor's null space can be
    nearly all of it: ``2049 x 1984`` int64 entries are 32 MB, a few copies of them).
    """
    n, k = Q.shape
    out: Optional[Tensor] = None
    for rows in row_slices(n, k):
        P = probe_matrix(n, k, Q.device, Q.dtype, rows=(rows.start, rows.stop))
        out = Q[rows].mT @ P if out is None else out.addmm_(Q[rows].mT, P)
    assert out is not None
    return out


def row_slices(n: int, k: int) -> List[slice]:
    """Slices of ``n`` rows of ``k`` entries: :data:`PROBE_SLICE` entries each (>= 1 row)."""
    step = max(1, PROBE_SLICE // k)
    return [slice(a, min(n, a + step)) for a in range(0, n, step)]
