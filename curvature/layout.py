"""The layout of a flat vector over parameters: names, shapes, offsets, flatten/unflatten.

Every dense object of the package (a ``[P, P]`` matrix, a ``[P]`` gradient or direction,
``[K, P]`` probes) lives in one layout: the parameters in a fixed order (for a model,
its trainable parameters in ``model.named_parameters()`` order, a shared parameter once),
each flattened row-major (``p.flatten()``) and concatenated. Parameter ``i`` with
``n_i = p_i.numel()`` entries occupies ``[o_i, o_i + n_i)`` with ``o_i = sum_{j<i} n_j``,
and ``P = sum_i n_i``. :class:`ParamLayout` is the single owner of that bookkeeping.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["ParamLayout", "ParamSharing", "tie_hint"]

Tensors = Union[Sequence[Optional[Tensor]], Dict[str, Optional[Tensor]]]


def _shapes_text(shapes: Iterable[Tuple[int, ...]]) -> str:
    return "[" + ", ".join(str(tuple(s)) for s in shapes) + "]"


def _describe(t: object) -> str:
    if t is None:
        return "None"
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


class ParamLayout:
    """Names, shapes and flat offsets of an ordered set of parameters.

    Parameter ``i`` (name ``names[i]``, shape ``shapes[i]``, ``n_i`` entries) occupies
    the flat positions ``offsets[names[i]] + [0, n_i)`` of a vector of length
    :attr:`numel` ``= P``, in row-major order.

    Example:
        >>> layout = ParamLayout.of(nn.Linear(3, 2))  # weight [2, 3], bias [2]
        >>> layout.offsets, layout.numel
        ({'weight': 0, 'bias': 6}, 8)
        >>> layout.unflatten(torch.arange(8.0))[1]
        tensor([6., 7.])

    Attributes:
        names: The parameter names, in order.
        params: The parameters themselves (not detached), in order.
        shapes: Their shapes.
        numels: Their numbers of entries ``n_i``.
        offsets: Name to the first flat position of the parameter.
        numel: ``P``, the length of the flat vector.

    """

    def __init__(self, named: Iterable[Tuple[str, Tensor]]):
        """The layout of the given ``(name, parameter)`` pairs, in the given order.

        Args:
            named: ``(name, tensor)`` pairs with distinct names, e.g.
                ``model.named_parameters()`` (a tensor given under two names occupies
                two spans; :meth:`of` lists a shared parameter once).

        Raises:
            ValueError: For a pair that is not ``(str, Tensor)`` or a repeated name.

        """
        names: List[str] = []
        params: List[Tensor] = []
        offsets: Dict[str, int] = {}
        total = 0
        for i, pair in enumerate(named):
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2
            if not ok or not isinstance(pair[0], str) or not isinstance(pair[1], Tensor):
                raise ValueError(
                    f"ParamLayout: entry {i} must be a (name: str, parameter: Tensor) pair, "
                    f"as in model.named_parameters(); got {pair!r:.80}."
                )
            name, p = pair
            if name in offsets:
                raise ValueError(
                    f"ParamLayout: the name {name!r} appears twice; names must be distinct."
                )
            names.append(name)
            params.append(p)
            offsets[name] = total
            total += p.numel()
        self.names: Tuple[str, ...] = tuple(names)
        self.params: Tuple[Tensor, ...] = tuple(params)
        self.shapes: Tuple[torch.Size, ...] = tuple(p.shape for p in params)
        self.numels: Tuple[int, ...] = tuple(p.numel() for p in params)
        self.offsets: Dict[str, int] = offsets
        self.numel: int = total
        self._starts: Tuple[int, ...] = tuple(offsets.values())
        self._spans: Dict[str, slice] = {
            n: slice(o, o + k) for n, o, k in zip(names, self._starts, self.numels)
        }

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        """The layout of ``model``'s trainable parameters (the SPEC's dense order).

        Args:
            model: Any module; DDP / DataParallel and ``torch.compile``'s wrappers are looked
                through (the plain model's names, as the capture's layer names).

        Returns:
            The parameters of ``model.named_parameters()`` with ``requires_grad=True``, in
            that order: a parameter shared by several modules appears once, under its
            first name; frozen parameters are left out.

        """
        from .layers.select import unwrap_model  # (layers import this module)

        model = unwrap_model(model)
        return cls((n, p) for n, p in model.named_parameters() if p.requires_grad)

    @classmethod
    def of_tensors(cls, tensors: Iterable[Tensor]) -> ParamLayout:
        """The layout of anonymous tensors, named ``"0"``, ``"1"``, ... in order."""
        return cls((str(i), t) for i, t in enumerate(tensors))

    def covered_names(self, indices: Sequence[Tensor]) -> List[str]:
        """The names of the parameters whose first flat position is in one of ``indices``.

        One boolean mask of length ``P`` on the indices' device, written once per index
        tensor, and one copy of it to the host (a single synchronization on a GPU): no
        Python set of all positions (``tolist`` of ``P`` integers costs tens of
        milliseconds for a model of a million parameters).

        Args:
            indices: Integer tensors of flat positions, any shape (on the first one's
                device; others are moved there).

        Returns:
            The covered names, in layout order.

        """
        if not self.numel or not indices:
            return []
        device = indices[0].device
        mask = torch.zeros(self.numel, dtype=torch.bool, device=device)
        for ix in indices:
            mask.index_fill_(0, ix.reshape(-1).to(device), True)  # no host scalar copied
        starts = torch.tensor(self._starts, dtype=torch.long).clamp_(max=self.numel - 1)
        firsts = (mask if device.type == "cpu" else mask.cpu())[starts].tolist()
        return [n for n, hit, k in zip(self.names, firsts, self.numels) if hit and k > 0]

    # -- lookups ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of parameters (not of entries: that is :attr:`numel`)."""
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is one of :attr:`names`."""
        return name in self.offsets

    def __repr__(self) -> str:
        """``ParamLayout(P=..., name shape, ...)``."""
        parts = ", ".join(f"{n} {tuple(s)}" for n, s in zip(self.names, self.shapes))
        return f"ParamLayout(P={self.numel}: {parts})"

    def span(self, name: str) -> slice:
        """The flat positions ``[o, o + n)`` of parameter ``name``.

        Raises:
            KeyError: For a name not in the layout.

        """
        if name not in self._spans:
            raise KeyError(
                f"ParamLayout: no parameter named {name!r}; the layout holds {list(self.names)}."
            )
        return self._spans[name]

    def index(self, names: Iterable[str]) -> Tensor:
        """The flat positions of ``names``' entries, concatenated in the given order.

        Args:
            names: Names in the layout.

        Returns:
            ``[sum_i n_i]`` int64 on the default device (CPU, or that of a
            ``torch.device`` context); empty for no names.

        Raises:
            KeyError: For a name not in the layout.

        """
        spans = [self.span(n) for n in names]
        if not spans:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(s.start, s.stop) for s in spans])

    def module_index(
        self, module: nn.Module, name: str, local_names: Optional[Iterable[str]] = None
    ) -> Tensor:
        """The flat positions of a module's trainable parameters that are in the layout.

        Args:
            module: A submodule of the model the layout was made of.
            name: Its name in the model (``""`` for the model itself).
            local_names: Only these of the module's parameters (e.g. a layer rule's
                ``param_names``: a rule may cover the module's direct parameters only);
                default all of ``module.named_parameters()``.

        Returns:
            ``[P_l]`` int64 (CPU): the entries of ``module.named_parameters()`` (in that
            order) with ``requires_grad=True`` whose full name ``f"{name}.{local}"`` is in
            the layout; a parameter the layout lists under another module's name (tied,
            see :class:`ParamSharing`) is left out. Empty if there is none.

        """
        prefix = f"{name}." if name else ""
        keep = None if local_names is None else set(local_names)
        return self.index(
            prefix + n
            for n, p in module.named_parameters()
            if p.requires_grad and prefix + n in self.offsets and (keep is None or n in keep)
        )

    def local_offsets(self, module_name: str) -> Dict[str, int]:
        """Offsets of the parameters under module ``module_name``, keyed by local name.

        Args:
            module_name: A module's name in the model (``""`` for the model itself).

        Returns:
            ``{"weight": o_w, "sub.bias": o_b, ...}``: every layout name that starts with
            ``f"{module_name}."`` with that prefix removed (all names for ``""``), in
            layout order; what a layer rule's ``kfac_index`` takes.

        """
        prefix = f"{module_name}." if module_name else ""
        return {n[len(prefix) :]: o for n, o in self.offsets.items() if n.startswith(prefix)}

    # -- flat <-> per-parameter ------------------------------------------------------------
    def flatten(
        self,
        tensors: Tensors,
        *,
        what: str = "v",
        batch_shape: Sequence[int] = (),
        none_as_zero: bool = False,
    ) -> Tensor:
        """Concatenate per-parameter tensors into one flat vector.

        With ``B = batch_shape``, tensor ``i`` is ``[*B, *shapes[i]]`` and the result is
        ``[*B, P]`` with ``out[..., o_i:o_i + n_i] = t_i.reshape(*B, n_i)``.

        Args:
            tensors: One tensor per parameter: a sequence in layout order, or a dict keyed
                by exactly the layout's names (any order).
            what: The argument's name in error messages.
            batch_shape: Leading axes ``B`` shared by all tensors (e.g. ``[K]`` for
                ``K`` vectors, or the output shape for a Jacobian).
            none_as_zero: Accept ``None`` for zero (as ``autograd.grad(...,
                allow_unused=True)`` returns for an unused input).

        Returns:
            ``[*B, P]``, in the promoted dtype of the tensors.

        Raises:
            ValueError: For a wrong number of tensors, missing or unexpected names, a
                wrong shape, or ``None`` without ``none_as_zero``; the message names
                ``what`` and the expected shapes.

        """
        B = tuple(batch_shape)
        expected = [B + tuple(s) for s in self.shapes]
        if isinstance(tensors, dict):
            missing = [n for n in self.names if n not in tensors]
            extra = [n for n in tensors if n not in self.offsets]
            if missing or extra:
                raise ValueError(
                    f"{what} must be a dict keyed by the parameter names {list(self.names)}; "
                    f"missing {missing}, unexpected {extra}."
                )
            ts = [tensors[n] for n in self.names]
        else:
            ts = list(tensors)
        bad = len(ts) != len(self.names) or any(
            (t is None and not none_as_zero)
            or (t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != e))
            for t, e in zip(ts, expected)
        )
        if bad:
            got = [_describe(t) for t in ts]
            raise ValueError(
                f"{what} must be {len(self.names)} tensors shaped like the parameters "
                f"{_shapes_text(expected)}: a list in the order {list(self.names)} or a "
                f"dict keyed by these names; got {len(ts)}: [{', '.join(got)}]."
            )
        if not ts:
            return torch.zeros(*B, 0)
        ref = next((t for t in ts if t is not None), None)
        parts = [
            (
                (ref.new_zeros(*B, n) if ref is not None else p.new_zeros(*B, n))
                if t is None
                else t.reshape(*B, n)
            )
            for t, p, n in zip(ts, self.params, self.numels)
        ]
        return torch.cat(parts, dim=-1)

    def _check_flat(self, flat: Tensor) -> None:
        if not isinstance(flat, Tensor) or flat.dim() < 1 or flat.shape[-1] != self.numel:
            got = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
            raise ValueError(
                f"ParamLayout: a flat vector must be [..., P] with P = {self.numel}; got {got}."
            )

    def unflatten(self, flat: Tensor) -> List[Tensor]:
        """Per-parameter views of a flat vector (the inverse of :meth:`flatten`).

        Args:
            flat: ``[*B, P]``.

        Returns:
            One view ``[*B, *shapes[i]]`` per parameter, in layout order (writing to a view
            writes to ``flat``).

        Raises:
            ValueError: If the last axis of ``flat`` is not ``P``.

        """
        self._check_flat(flat)
        B = flat.shape[:-1]
        return [
            flat[..., o : o + n].view((*B, *s))
            for o, n, s in zip(self._starts, self.numels, self.shapes)
        ]

    def unflatten_dict(self, flat: Tensor) -> Dict[str, Tensor]:
        """:meth:`unflatten` keyed by name, in layout order."""
        return dict(zip(self.names, self.unflatten(flat)))

    # -- the parameters' own values --------------------------------------------------------
    def flat_grads(self, dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
        """The parameters' ``.grad`` as one flat vector.

        Args:
            dtype: The result's dtype (``None``: that of the first existing gradient).

        Returns:
            ``[P]`` on the first gradient's device, zeros where ``.grad`` is ``None``; or
            ``None`` if no parameter has a gradient.

        """
        ref = next((p.grad for p in self.params if p.grad is not None), None)
        if ref is None:
            return None
        flat = torch.zeros(self.numel, dtype=dtype or ref.dtype, device=ref.device)
        for p, o, n in zip(self.params, self._starts, self.numels):
            if p.grad is not None:
                flat[o : o + n] = p.grad.reshape(-1)
        return flat

    def flat_params(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The parameters' values as one detached flat vector ``[P]`` (a copy).

        Args:
            dtype: The result's dtype (``None``: the promoted dtype of the parameters).

        """
        parts = [p.detach().reshape(-1) for p in self.params]
        if dtype is not None:
            parts = [t.to(dtype) for t in parts]
        if not parts:
            return torch.zeros(0, dtype=dtype)
        return torch.cat(parts)


class ParamSharing:
    """Which trainable parameters several layers use (tied weights), found by identity.

    A language model's tied embedding (``head.weight = emb.weight``) is one parameter
    that two layers use: ``model.named_parameters()`` lists it once, under its first
    name (``"emb.weight"``, the *canonical* name), and the head's own name for it
    (``"weight"`` locally, ``"head.weight"`` in the model) appears nowhere. The gradient
    of such a parameter is the sum of the contributions of every layer that uses it;
    this class tells the estimators where to sum.

    Example:
        >>> sharing = ParamSharing(model, [("emb", model.emb, ["weight"]),
        ...                                ("head", model.head, ["weight"])])
        >>> sharing.names["head"], sharing.shared
        ({'weight': 'emb.weight'}, {'emb.weight': ['emb', 'head']})

    Attributes:
        names: Layer name to ``{local name: canonical name}`` of the parameters it uses.
        shared: Canonical name to the layers using it, for the parameters used by two or
            more layers (in layer order).
        groups: The layers connected by shared parameters, one list per group (layer
            order; a layer belongs to at most one group).

    """

    def __init__(self, model: nn.Module, layers: Iterable[Tuple[str, nn.Module, Iterable[str]]]):
        """Find the parameters shared by ``layers``.

        Args:
            model: The model the layers belong to.
            layers: ``(layer name, module, local parameter names)`` of the covered layers
                (e.g. ``rule.param_names(module)``: the trainable parameters a rule
                covers).

        """
        canonical: Dict[int, str] = {}
        for n, p in model.named_parameters():
            canonical.setdefault(id(p), n)
        self.names: Dict[str, Dict[str, str]] = {}
        users: Dict[str, List[str]] = {}
        for name, module, local_names in layers:  # (a lookup each, not a walk per layer)
            prefix = f"{name}." if name else ""
            local = {n: canonical.get(id(module.get_parameter(n)), prefix + n) for n in local_names}
            self.names[name] = local
            for c in local.values():
                users.setdefault(c, []).append(name)
        self.shared: Dict[str, List[str]] = {c: ls for c, ls in users.items() if len(ls) > 1}
        # connected components of layers linked by shared parameters
        group_of: Dict[str, int] = {}
        groups: List[List[str]] = []
        for members in self.shared.values():
            found = sorted({group_of[m] for m in members if m in group_of})
            merged = [m for i in found for m in groups[i]] + members
            for i in reversed(found):
                groups[i] = []
            groups.append(merged)
            for m in merged:
                group_of[m] = len(groups) - 1
        order = list(self.names)
        self.groups: List[List[str]] = [sorted(set(g), key=order.index) for g in groups if g]
        self._group_of = {m: i for i, g in enumerate(self.groups) for m in g}

    def __bool__(self) -> bool:
        """Whether any parameter is shared by two or more layers."""
        return bool(self.shared)

    def tied(self, layer: str) -> bool:
        """Whether ``layer`` uses a parameter that another layer uses too."""
        return layer in self._group_of

    def group(self, layer: str) -> List[str]:
        """The layers tied to ``layer`` (itself included), in layer order."""
        return self.groups[self._group_of[layer]]

    def group_name(self, layer: str) -> str:
        """The name of ``layer``'s group: its members joined by ``"+"`` (``"emb+head"``)."""
        return "+".join(self.group(layer))

    def group_params(self, layer: str) -> List[str]:
        """Canonical names of every parameter of ``layer``'s group, without repeats."""
        out: List[str] = []
        for m in self.group(layer):
            out.extend(c for c in self.names[m].values() if c not in out)
        return out

    def describe(self, canonical: str) -> str:
        """``"'emb.weight' (tied: used by layers 'emb' and 'head')"``."""
        layers = [f"'{n or '<model>'}'" for n in self.shared[canonical]]
        used = ", ".join(layers[:-1]) + " and " + layers[-1]
        return f"'{canonical}' (tied: used by layers {used})"

    def tie_reasons(self) -> Dict[str, str]:
        """Canonical name to why it has no Kronecker block, for every tied layer's parameter.

        The shared parameters are described by :meth:`describe`; the other parameters of
        a tied layer by the tie of their layer.
        """
        out: Dict[str, str] = {}
        for c in self.shared:
            out[c] = self.describe(c)
        for group in self.groups:
            for m in group:
                for c in self.names[m].values():
                    if c not in out:
                        out[c] = f"'{c}' (its layer '{m}' uses a tied parameter)"
        return out


def tie_hint(alternatives: str) -> str:
    """The way out for a tied parameter that a Kronecker block cannot represent."""
    return (
        "A Kronecker block cannot represent a parameter that several layers use: untie "
        "the weights (e.g. head.weight = nn.Parameter(emb.weight.detach().clone())), or "
        f"{alternatives} (exact for tied parameters: the diagonal of the summed gradients)."
    )


class DeviceIndices:
    """Index tensors copied to a device once: no host-to-device copy per call.

    ``indices(index, device)`` is ``index.to(device)``, kept for the next call (the
    entry holds ``index`` itself, so its id stays its own).
    """

    def __init__(self) -> None:
        self.copies: Dict[Tuple[int, str], Tuple[Tensor, Tensor]] = {}

    def __call__(self, index: Tensor, device: torch.device) -> Tensor:
        if index.device == device:
            return index
        key = (id(index), str(device))
        hit = self.copies.get(key)
        if hit is None or hit[0] is not index:
            hit = self.copies[key] = (index, index.to(device))
        return hit[1]


def take(flat: Tensor, index: Tensor) -> Tensor:
    """``flat[index]`` shaped like ``index`` (``index_select``: several times faster)."""
    return flat.index_select(0, index.reshape(-1)).view(index.shape)


def put(flat: Tensor, index: Tensor, values: Tensor) -> None:
    """``flat[index] = values`` in place (``index_copy_``), cast to ``flat``'s dtype."""
    flat.index_copy_(0, index.reshape(-1), values.reshape(-1).to(flat.dtype))
