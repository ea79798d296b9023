"""Checking a saved optimizer state against the optimizer that loads it.

``load_state_dict`` validates the whole state before changing anything: the parameter
groups and the per-parameter state (``momentum_buffer`` shaped like its parameter), the
curvature family (Kronecker blocks for :class:`~curvature.KFAC` / :class:`~curvature.EKFAC`,
diagonals for :class:`~curvature.DiagonalNaturalGradient`), every block name (a block of
this model and of the same structure) and every tensor's shape. A mismatch raises a
``ValueError`` naming the key, the saved and the expected shape, and the way out.

Block names saved from a ``torch.compile``'d model by earlier versions carry the
wrapper's prefix (``_orig_mod.fc`` for ``fc``); it is removed here.

Shapes of a Kronecker block with index ``[C, D_out, D]`` (``C`` groups, ``D`` inputs with
the bias): ``A``, ``QA``, ``PA`` ``[C, D, D]``; ``G``, ``QG``, ``PG`` ``[C, D_out, D_out]``;
``lA``, ``muA`` ``[C, D]``; ``lG``, ``muG`` ``[C, D_out]``; EKFAC's ``corrections``
``[C, D_out, D]``.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor

from ..blocks.records import RECORDS
from ..layer_stats import block_name
from ..warn import warn

Key = Tuple[str, str]

#: The prefix ``torch.compile``'s wrapper puts before the names of the model's modules.
COMPILED_PREFIX = "_orig_mod"

#: ``C``: groups, ``O``: outputs (``D_out``), ``D``: inputs (with the bias).
SHAPES = {
    "A": "CDD",
    "QA": "CDD",
    "PA": "CDD",
    "G": "COO",
    "QG": "COO",
    "PG": "COO",
    "lA": "CD",
    "muA": "CD",
    "lG": "CO",
    "muG": "CO",
    "corrections": "COD",
}
KRONECKER_TYPES = ("KroneckerBlock", "EigenCorrectedBlock", "KroneckerSumBlock")
COMMON = ("steps", "skipped_statistics", "generator")

WAY_OUT = (
    "Load a state saved by the same optimizer class on the same architecture (layer "
    "widths, frozen parameters, param groups, max_factor_size and unsupported as when it "
    "was saved); to start the curvature afresh, load only the model's state_dict and "
    "build a new optimizer."
)


def shape_str(shape: Sequence[int]) -> str:
    """``[3, 4]``."""
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def refuse(who: str, what: str) -> ValueError:
    """The ``ValueError`` of ``who.load_state_dict`` for ``what``, with the way out."""
    return ValueError(f"{who}.load_state_dict: {what}. {WAY_OUT}")


def check_tensor(who: str, where: str, value: Any, shape: Sequence[int]) -> None:
    """``value`` is a tensor of ``shape``, else a ``ValueError`` naming ``where``."""
    if not isinstance(value, Tensor):
        raise refuse(
            who, f"{where} is a {type(value).__name__}, expected a tensor {shape_str(shape)}"
        )
    if tuple(value.shape) != tuple(shape):
        raise refuse(
            who,
            f"{where} has saved shape {shape_str(value.shape)}, expected {shape_str(shape)} "
            "(a model of other layer widths?)",
        )


def plain_name(name: str, known: Any) -> str:
    """A layer name saved from ``torch.compile``'s wrapper, as the plain model names it."""
    if name in known or not name.startswith(COMPILED_PREFIX):
        return name
    if name == COMPILED_PREFIX:
        return ""
    if name.startswith(COMPILED_PREFIX + "."):
        return name[len(COMPILED_PREFIX) + 1 :]
    return name


def saved_by(state: Mapping[str, Any]) -> str:
    """The class that saved a curvature state (from its structure for older states)."""
    if "optimizer" in state:
        return str(state["optimizer"])
    if "diagonals" in state:
        return "DiagonalNaturalGradient"
    types = {b.get("type") for b in state.get("blocks", {}).values() if isinstance(b, Mapping)}
    return "EKFAC" if "EigenCorrectedBlock" in types else "KFAC"


def check_common(who: str, state: Any, family: str, needs: Sequence[str]) -> Dict[str, Any]:
    """The curvature entry is a dict of the loading optimizer's family (``needs`` its keys)."""
    if not isinstance(state, Mapping):
        raise refuse(who, f"state['curvature'] is a {type(state).__name__}, expected a dict")
    missing = [k for k in (*COMMON, *needs) if k not in state]
    if missing:
        by = saved_by(state)
        into = "KFAC or EKFAC" if by in ("KFAC", "EKFAC") else by
        raise refuse(
            who,
            f"the state was saved by {by}, whose curvature ({sorted(map(str, state))}) is "
            f"not {family} (missing {missing}); a {by} state loads only into {into}",
        )
    return dict(state)


def renamed(entries: Any, who: str, what: str, known: Any) -> Dict[Any, Any]:
    """``entries`` (a dict keyed by layer name or ``(name, suffix)``) with plain names."""
    if not isinstance(entries, Mapping):
        raise refuse(who, f"state['curvature'][{what!r}] is not a dict")
    out: Dict[Any, Any] = {}
    for k, v in entries.items():
        if isinstance(k, (tuple, list)) and len(k) == 2:
            out[(plain_name(str(k[0]), known), str(k[1]))] = v
        elif isinstance(k, str):
            out[plain_name(k, known)] = v
        else:
            raise refuse(who, f"state['curvature'][{what!r}] has the key {k!r}, not a block name")
    return out


def check_kronecker_block(who: str, name: str, state: Any, index_shape: Sequence[int]) -> None:
    """A saved Kronecker block (factors, record, corrections) fits an index ``[C, O, D]``."""
    if not isinstance(state, Mapping) or state.get("type") not in KRONECKER_TYPES:
        kind = state.get("type") if isinstance(state, Mapping) else type(state).__name__
        raise refuse(who, f"block '{name}' was saved as {kind!r}, not one of {KRONECKER_TYPES}")
    dims = dict(zip("COD", index_shape))

    def expect(field: str, value: Any, where: str) -> None:
        if value is not None and field in SHAPES:
            check_tensor(who, where, value, [dims[c] for c in SHAPES[field]])

    if state["type"] == "KroneckerSumBlock":
        for t, pair in dict(state.get("terms", {})).items():
            for field, value in zip("AG", pair):
                expect(field, value, f"block '{name}' term {t} {field}")
    else:
        for field in ("A", "G", "corrections"):
            expect(field, state.get(field), f"block '{name}' {field}")
    record = state.get("record")
    if record is not None:
        if not isinstance(record, Mapping) or record.get("kind") not in RECORDS:
            raise refuse(who, f"block '{name}' has a record of unknown kind")
        for field, value in record.items():
            expect(field, value, f"block '{name}' record {field}")


def check_kronecker_state(
    who: str,
    state: Any,
    index: Mapping[Key, Tensor],
    diagonal: Mapping[Key, Tensor],
    layers: Collection[str],
) -> Dict[str, Any]:
    """A KFAC / EKFAC curvature state, validated, with plain block names.

    Args:
        who: The loading optimizer's class name.
        state: The saved ``state_dict()["curvature"]``.
        index: This optimizer's Kronecker blocks: key to index ``[C, D_out, D]``.
        diagonal: This optimizer's possible diagonal blocks: key to flat positions
            ``[P_b]`` (they replace the saved positions).
        layers: The names of the model's layers.

    Returns:
        The state with block keys of this model and the diagonal blocks' positions.

    Raises:
        ValueError: For a state of another family, an unknown block name, a block of
            another structure, or a tensor of another shape.

    """
    state = check_common(who, state, "Kronecker blocks", ("blocks", "diag", "terms"))
    known = set(layers)
    names = sorted(block_name(*k) or "<model>" for k in (*index, *diagonal))
    structure = "(another block structure: max_factor_size, unsupported or fisher differ)"

    def unknown(key: Key, saved_as: str, here: Mapping[Key, Any], other: str) -> ValueError:
        label = block_name(*key) or "<model>"
        if key in here:
            return refuse(
                who,
                f"block '{label}' was saved as a {saved_as} block, this optimizer makes it a "
                f"{other} block {structure}",
            )
        if key[0] in known:
            return refuse(
                who,
                f"block '{label}' was saved as a {saved_as} block, this optimizer has no "
                f"block for it {structure}",
            )
        return refuse(who, f"block '{label}' is not a block of this model (its blocks: {names})")

    blocks = renamed(state["blocks"], who, "blocks", known)
    for key, st in sorted(blocks.items(), key=lambda kv: str(kv[0])):
        if key not in index:
            raise unknown(key, "Kronecker", diagonal, "diagonal")
        check_kronecker_block(who, block_name(*key), st, index[key].shape)
    diag = renamed(state["diag"], who, "diag", known)
    for key, st in sorted(diag.items(), key=lambda kv: str(kv[0])):
        if key not in diagonal:
            raise unknown(key, "diagonal", index, "Kronecker")
        diag[key] = check_diagonal(who, block_name(*key), st, [diagonal[key]])
    terms = renamed(state["terms"], who, "terms", known)
    state.update(blocks=blocks, diag=diag, terms=terms)
    return state


def warn_dropped_corrections(who: str, blocks: Mapping[Key, Any]) -> None:
    """Warn that EKFAC's eigenvalue corrections in ``blocks`` are not loaded (into KFAC)."""
    corrected = [block_name(*k) for k, b in blocks.items() if b.get("corrections") is not None]
    if corrected:
        warn(
            f"{who}.load_state_dict: the state holds EKFAC's eigenvalue corrections of "
            f"{sorted(corrected)}; they are dropped (the Kronecker factors are kept, and "
            "decomposed again). Load it into EKFAC to keep them."
        )


def check_diagonal(who: str, name: str, state: Any, candidates: List[Tensor]) -> Dict[str, Any]:
    """A saved diagonal block on the positions of one of ``candidates`` (``[P_b]`` each).

    The saved positions must be those of a candidate up to their order; the state is
    returned with the positions of the first candidate that has them, in the saved order
    where the candidate is the only one.
    """
    if not isinstance(state, Mapping) or "index" not in state or "d" not in state:
        raise refuse(who, f"diagonal '{name}' is not a saved DiagonalBlock")
    saved = state["index"]
    if not isinstance(saved, Tensor) or saved.dim() != 1:
        raise refuse(who, f"diagonal '{name}' has no 1-dim index of positions")
    sizes = sorted({c.numel() for c in candidates})
    match = [c for c in candidates if c.numel() == saved.numel()]
    if not match:
        raise refuse(
            who,
            f"diagonal '{name}' index has saved shape {shape_str(saved.shape)}, expected "
            f"{' or '.join(shape_str([n]) for n in sizes)} (a model of other layer widths?)",
        )
    same = [c for c in match if torch.equal(c.sort().values, saved.sort().values)]
    if not same:
        raise refuse(
            who,
            f"diagonal '{name}' covers other parameter positions than this model's layer "
            "(other widths or frozen parameters in the layers before it?)",
        )
    if state["d"] is not None:
        check_tensor(who, f"diagonal '{name}' d", state["d"], saved.shape)
    index = saved if len(candidates) > 1 else same[0]
    return {**state, "index": index.clone()}


def check_diagonal_state(
    who: str, state: Any, candidates: Mapping[str, List[Tensor]]
) -> Dict[str, Any]:
    """A ``DiagonalNaturalGradient`` curvature state, validated, with plain layer names.

    Args:
        who: The loading optimizer's class name.
        state: The saved ``state_dict()["curvature"]``.
        candidates: Layer name to the possible position lists ``[P_l]`` of its diagonal.

    Raises:
        ValueError: For a state of another family, an unknown layer, or other shapes.

    """
    state = check_common(who, state, "per-layer diagonals", ("diagonals",))
    diagonals = renamed(state["diagonals"], who, "diagonals", candidates)
    for name, st in sorted(diagonals.items(), key=lambda kv: str(kv[0])):
        if name not in candidates:
            raise refuse(
                who,
                f"diagonal '{name}' is not a layer of this model (its layers: "
                f"{sorted(candidates)})",
            )
        diagonals[name] = check_diagonal(who, name, st, candidates[name])
    state["diagonals"] = diagonals
    return state


def check_param_state(
    who: str, state_dict: Mapping[str, Any], groups: Sequence[Dict[str, Any]], names: Mapping
) -> None:
    """The saved param groups match the optimizer's, and each buffer its parameter's shape.

    Args:
        who: The loading optimizer's class name.
        state_dict: The saved ``state_dict()`` (``state``, ``param_groups``).
        groups: The loading optimizer's ``param_groups``.
        names: Parameter to its name in the model.

    """
    saved = state_dict.get("param_groups")
    per_param = state_dict.get("state")
    if not isinstance(saved, Sequence) or not isinstance(per_param, Mapping):
        raise refuse(who, "the state has no 'param_groups' list and 'state' dict")
    if len(saved) != len(groups):
        raise refuse(
            who, f"the state has {len(saved)} param group(s), this optimizer {len(groups)}"
        )
    for i, (sg, g) in enumerate(zip(saved, groups)):
        ids = list(sg.get("params", ()))
        if len(ids) != len(g["params"]):
            raise refuse(
                who,
                f"param group {i} has {len(ids)} saved parameter(s), this optimizer's "
                f"{len(g['params'])}",
            )
        for sid, p in zip(ids, g["params"]):
            for k, v in dict(per_param.get(sid, {})).items():
                if isinstance(v, Tensor) and v.dim() > 0:
                    check_tensor(who, f"{k} of parameter '{names.get(p, '?')}'", v, p.shape)
