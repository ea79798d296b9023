"""Sampling generators: one per device, seeded from one seed (the optimizers', ``kfac()``'s).

MC labels and Rademacher signs are drawn on the device of the output they belong to, so
nothing is copied to the host to sample. The CPU generator is the optimizer's
``generator`` (its draws are those of earlier versions on CPU); a generator for another
device is created at its first draw, seeded with the CPU generator's seed of the
moment. Every generator's state is saved in the optimizer's ``state_dict``, so a
resumed run draws the same numbers.
"""

from __future__ import annotations

from typing import Any, Dict

import torch


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
