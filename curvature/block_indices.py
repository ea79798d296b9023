"""Flat positions of the curvature blocks: each layer's ``kfac_index`` on a device.

A Kronecker block of a layer is laid out by the rule's
:meth:`~curvature.layers.LayerRule.kfac_index`: ``[C, D_out, D]`` flat positions of the
entries of ``[W | b]``. The built-in Linear-family index
(:meth:`~curvature.layers.LinearFamilyRule.kfac_index` of the ``nn.Linear`` and
convolution rules)
depends only on a few integers (the weight's and bias's offsets and the matrix shape),
so it is kept between calls (:func:`linear_index`: a per-call host cost of a few aten
calls per layer, a kernel launch each on a GPU, and nothing to build from the second
call on), and what it covers is known without reading it (:meth:`BlockIndices.covers`).
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .layers import LayerRule
from .layers.conv import ConvRule
from .layers.linear import LinearRule
from .layout import ParamLayout

#: Entries of the built-in Linear-family indices kept between calls, in all (int64: 8
#: bytes each), and of one index at most: larger layers build theirs per call.
CACHED_INDEX_NUMEL, MAX_CACHED_INDEX = 1 << 22, 1 << 20

_LINEAR_CACHE: OrderedDict = OrderedDict()  # key -> index [C, D_out, D], least recent first


def clear_index_cache() -> None:
    """Drop every index :func:`linear_index` keeps (their device memory is freed)."""
    _LINEAR_CACHE.clear()


def layer_positions(layout: ParamLayout, name: str, module: nn.Module, rule: LayerRule) -> Tensor:
    """``[P_l]`` flat positions of the parameters the rule covers, ``named_parameters`` order."""
    return layout.module_index(module, name, rule.param_names(module))


def _builtin_linear(rule: LayerRule) -> bool:
    """The built-in ``nn.Linear`` and convolution rules themselves (not a subclass)."""
    return type(rule) in (LinearRule, ConvRule)


def _trainable(module: nn.Module, name: str) -> bool:
    p = getattr(module, name, None)
    return p is not None and p.requires_grad


def linear_index(
    rule: LayerRule, module: nn.Module, offsets: Dict[str, int], device: torch.device
) -> Dict[str, Tensor]:
    """The built-in Linear-family ``kfac_index`` on ``device``, kept for the next calls.

    Equal to ``rule.kfac_index(module, offsets, device=device)``; the same tensor is
    handed out again for the same offsets, shape and device (do not modify it in
    place). At most :data:`CACHED_INDEX_NUMEL` entries are kept (least recently used
    dropped first), none of an index over :data:`MAX_CACHED_INDEX` entries.
    """
    weight, bias = module.weight, module.bias
    ref = weight if weight is not None else bias
    key = (
        offsets["weight"] if weight is not None and weight.requires_grad else -1,
        offsets["bias"] if bias is not None and bias.requires_grad else -1,
        () if weight is None else tuple(weight.shape),
        ref.shape[0],
        getattr(module, "groups", 1),
        device if isinstance(device, torch.device) else torch.device(device),
    )
    index = _LINEAR_CACHE.get(key)
    if index is not None:
        _LINEAR_CACHE.move_to_end(key)
        return {"": index}
    index = rule.kfac_index(module, offsets, device=device)[""]
    if index.numel() <= MAX_CACHED_INDEX:
        _LINEAR_CACHE[key] = index
        total = sum(ix.numel() for ix in _LINEAR_CACHE.values())
        while total > CACHED_INDEX_NUMEL:
            total -= _LINEAR_CACHE.popitem(last=False)[1].numel()
    return {"": index}


def layer_offsets(layout: ParamLayout, name: str, rule: LayerRule) -> Dict[str, int]:
    """What ``rule.kfac_index`` of layer ``name`` reads of the layout's offsets.

    :meth:`~curvature.layout.ParamLayout.local_offsets` (every parameter under the
    layer, a scan of all names); for the built-in Linear and convolution rules only
    their ``weight`` and ``bias`` (two look-ups).
    """
    if not _builtin_linear(rule):
        return layout.local_offsets(name)
    prefix = f"{name}." if name else ""
    offsets = layout.offsets
    return {n: offsets[prefix + n] for n in ("weight", "bias") if prefix + n in offsets}


def add_linear_block(
    flat: Tensor, rule: LayerRule, module: nn.Module, offsets: Dict[str, int], parts
) -> bool:
    """``flat[index] += d`` for the built-in Linear-family index, without the index.

    ``parts``: block suffix to values like the index (``{"": d}`` for these rules), ``d
    [C, D_out / C, D]`` laid out like :meth:`~curvature.layers.LinearFamilyRule.
    kfac_index` (the weight's ``D_in`` columns, then the bias column): the weight's span
    of ``flat`` viewed as ``[D_out, D_in]`` gets the first columns, the bias's span the
    last, as two strided adds (the same sums as ``index_add_``, bit for bit; no scatter
    over the layer's entries, no index). ``False`` (nothing done) for any other rule.
    """
    if not _builtin_linear(rule):
        return False
    d, weight, bias = parts[""], module.weight, module.bias
    rows = (weight if weight is not None else bias).shape[0]
    if d.numel() == 0:  # no rows or no trainable columns: nothing to add
        return True
    d = d.reshape(rows, -1)
    if weight is not None and weight.requires_grad:
        start, cols = offsets["weight"], weight.numel() // max(rows, 1)
        flat[start : start + rows * cols].view(rows, cols).add_(d[:, :cols])
    if bias is not None and bias.requires_grad:
        flat[offsets["bias"] : offsets["bias"] + rows].add_(d[:, -1])
    return True


def block_index(
    rule: LayerRule, module: nn.Module, offsets: Dict[str, int], device: torch.device
) -> Optional[Dict[str, Tensor]]:
    """``rule.kfac_index(module, offsets)`` built on ``device`` (no host build and copy).

    The built-in Linear family's index comes from :func:`linear_index` (kept between
    calls). Other rules: with the ``device`` argument where the rule's ``kfac_index``
    takes one (the built-in rules: no ``torch.device`` context, whose function mode
    intercepts every torch call inside), else inside a ``torch.device(device)`` context.
    """
    if _builtin_linear(rule):
        return linear_index(rule, module, offsets, device)
    if _index_takes_device(type(rule)):
        return rule.kfac_index(module, offsets, device=device)
    with torch.device(device):
        return rule.kfac_index(module, offsets)


@functools.cache
def _index_takes_device(cls: type) -> bool:
    return "device" in inspect.signature(cls.kfac_index).parameters


class BlockIndices:
    """``(name, suffix, device)`` to a block's index ``[C, D_out, D]``, built on ``device``.

    :func:`curvature.kfac` calls it with the factors' device (no host build and copy per
    call); each layer's ``kfac_index`` is built once per device and shared by the layer's
    blocks. A layer without one (an exact block) gets ``[1, P_l, 1]``, its trainable
    parameters' positions (:func:`layer_positions`).

    Args:
        layers: Layer name to ``(module, rule)``.
        layout: The model's :class:`~curvature.layout.ParamLayout`.

    """

    def __init__(self, layers: Dict[str, Tuple[nn.Module, LayerRule]], layout: ParamLayout):
        self.layers, self.layout = layers, layout
        self.built: Dict[Tuple[str, torch.device], object] = {}
        self.known: Dict[str, List[str]] = {}  # see covers()
        self.used: List[Tuple[str, Tensor]] = []  # (layer name, index) handed out

    def __call__(self, name: str, suffix: str, device: torch.device) -> Tensor:
        """The index of block ``suffix`` of layer ``name`` on ``device``."""
        key = (name, device)
        if key not in self.built:
            module, rule = self.layers[name]
            offsets = layer_offsets(self.layout, name, rule)
            self.built[key] = block_index(rule, module, offsets, device)
            if self.built[key] is None:  # exact block over the trainable parameters
                with torch.device(device):
                    ix = layer_positions(self.layout, name, module, rule)
                self.built[key] = ix.view(1, -1, 1)
            elif _builtin_linear(rule):
                prefix = f"{name}." if name else ""
                names = [n for n in ("weight", "bias") if _trainable(module, n)]
                self.known[name] = [prefix + n for n in names]
        index = self.built[key]
        index = index if isinstance(index, Tensor) else index[suffix]
        self.used.append((name, index))
        return index

    def covers(self, name: str) -> Optional[List[str]]:
        """The layout names the index of layer ``name`` covers, if known without reading it.

        The built-in Linear-family index covers the trainable ``weight`` and ``bias``
        whole; ``None`` for any other rule (a custom ``kfac_index`` may leave entries
        out: its index is read).
        """
        return self.known.get(name)

    def covered_names(self) -> List[str]:
        """The layout names the indices handed out cover, in layout order.

        Known covers (:meth:`covers`) need no read; the other indices are read with
        :meth:`~curvature.layout.ParamLayout.covered_names` (one copy to the host, none
        if every index is known).
        """
        known = {n for name, _ in self.used for n in (self.covers(name) or ())}
        read = [ix.reshape(-1) for name, ix in self.used if self.covers(name) is None]
        covered = known.union(self.layout.covered_names(read))
        return [n for n in self.layout.names if n in covered]
