"""Blocks over ``max_factor_size`` in the KFAC / EKFAC optimizers.

``large_factors="diagonal_factor"`` (default): a :class:`~curvature.blocks.OneSidedBlock`
(the small factor full, the large one as its diagonal, from the layer's per-vector
inputs and output gradients, never forming the large factor); an embedding keeps ``A``
(the token counts) diagonal and ``G`` full. Layers whose rule gives neither per-vector
matrices nor a diagonal input factor keep the per-sample Fisher diagonal.
``"per_sample_diagonal"``: a :class:`~curvature.blocks.DiagonalBlock` with the
per-sample Fisher diagonal (the behaviour before the one-sided blocks).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Dict, Mapping, Tuple

from torch import Tensor

from ..blocks import DiagonalBlock, OneSidedBlock, onesided_sides
from ..blocks.onesided import TYPE
from ..layer_stats import (
    at_positions,
    block_name,
    expanded_diagonal,
    fisher_diagonal,
    onesided_factors,
)
from ..layers.base import expanded_kfac
from ..layers.registry import library_method
from .checkpoint import refuse
from .statistics import stat_dtype

Key = Tuple[str, str]
MODES = ("diagonal_factor", "per_sample_diagonal")
KINDS = ("A", "G", "g")


def check_mode(who: str, mode: Any) -> str:
    """``large_factors``, validated."""
    if mode not in MODES:
        raise ValueError(
            f"{who}(large_factors={mode!r}): 'diagonal_factor' (default; the small Kronecker "
            "factor full, the large one diagonal) or 'per_sample_diagonal' (the per-sample "
            "Fisher diagonal of the block)."
        )
    return mode


def large_message(opt, names) -> str:
    """The warning naming the blocks over ``max_factor_size`` and what they become."""
    what = (
        "keep that factor as its diagonal (OneSidedBlock)"
        if opt.large_factors == "diagonal_factor"
        else "are preconditioned by their per-sample Fisher diagonal"
    )
    return (
        f"{type(opt).__name__}: Kronecker factors larger than max_factor_size="
        f"{opt.max_factor_size} in {names}; these blocks {what}."
    )


def accumulate_large(
    name: str, module, rule, calls, approx: str, large: Mapping[Key, Tensor], opt, emit: Callable
) -> None:
    """Emit the statistics of a layer with blocks over the limit (``large``: key to index).

    One-sided blocks get ``[A, G]`` (kinds ``A``, ``G``: normalized like KFAC's factors),
    per-sample diagonal blocks ``[d]`` (kind ``g``), the layer's other blocks KFAC's
    ``[A, G, None]``.
    """
    large = {k[1]: ix for k, ix in large.items() if k[0] == name}
    if opt.large_factors == "diagonal_factor":
        want = {s: onesided_sides(ix, opt.max_factor_size) for s, ix in large.items()}
        res = onesided_factors(rule, module, calls, approx, want)
        if res is not None:
            # new tensors of this step, but where a rule of one's own hands its diagonal
            # input over (kfac_diagonal_input, which may keep it)
            owned = library_method(rule, "kfac_diagonal_input")
            for suffix, (A, G, count) in res.items():
                dt = stat_dtype(A)
                kinds = ("A", "G") if suffix in large else KINDS
                values = [A.to(dt), G.to(dt), None][: len(kinds)]
                emit((name, suffix), values, kinds, count, owned)
            return
    expanded = rule.expanded_blocks(module, calls)
    if expanded is None:  # one block (Embedding): its diagonal in block layout
        d = fisher_diagonal(rule, module, calls)[1][""]
        pos = opt.layout.module_index(module, name)
        for suffix, ix in large.items():
            dd = at_positions(d, pos, ix)
            emit((name, suffix), [dd.to(stat_dtype(dd))], ("g",))
        return
    for suffix, (a, g) in expanded.items():
        if suffix in large:
            d = expanded_diagonal(a, g)
            emit((name, suffix), [d.to(stat_dtype(d))], ("g",))
        else:
            A_sum, G_sum, count = expanded_kfac(a, g, approx)
            dt = stat_dtype(A_sum)
            emit((name, suffix), [A_sum.to(dt), G_sum.to(dt), None], KINDS, count)


def new_block(key: Key, values, index: Tensor, max_factor_size: int):
    """The block for the first statistics of a block without a Kronecker index."""
    if len(values) == 2:  # one-sided statistics [A, G]
        return OneSidedBlock(block_name(*key), index, *onesided_sides(index, max_factor_size))
    return DiagonalBlock(block_name(*key), index.reshape(-1))


def split_state(
    who: str, state: Any, mode: str, large: Mapping[Key, Tensor], kronecker: Collection[Key]
) -> Tuple[Any, Dict]:
    """The curvature state without its one-sided blocks, and those blocks' states (checked).

    Refuses a state saved with the other ``large_factors`` when this model has blocks
    over the limit.
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("diag"), Mapping):
        return state, {}
    saved = state.get("large_factors", "per_sample_diagonal")
    if large and saved != mode:
        raise refuse(
            who,
            f"the state was saved with large_factors={saved!r}, this optimizer uses "
            f"large_factors={mode!r} for its blocks over max_factor_size "
            f"({sorted(block_name(*k) for k in large)}); pass large_factors={saved!r} to "
            "load it",
        )
    labels = {block_name(*k): k for k in large}
    rest, onesided = {}, {}
    for k, st in sorted(state["diag"].items(), key=lambda kv: str(kv[0])):
        if not (isinstance(st, Mapping) and st.get("type") == TYPE):
            rest[k] = st
            continue
        label = block_name(*k) if isinstance(k, (tuple, list)) else str(k)
        key = labels.get(label)
        if key is None:
            here = "a Kronecker block" if label in {block_name(*k) for k in kronecker} else "none"
            raise refuse(
                who,
                f"block '{label}' was saved as a diagonal block, this optimizer makes it "
                f"{here} (another block structure: max_factor_size, unsupported or fisher "
                "differ)",
            )
        ix = large[key]
        if st.get("index") is None or tuple(st["index"].shape) != tuple(ix.shape):
            raise refuse(who, f"one-sided block '{label}' has another shape than {list(ix.shape)}")
        onesided[key] = st
    return {**state, "diag": rest}, onesided


def restore_onesided(
    who: str, states: Mapping[Key, Any], large: Mapping[Key, Tensor], max_factor_size: int
) -> Dict[Key, OneSidedBlock]:
    """The one-sided blocks of :func:`split_state`, on this model's positions."""
    out = {}
    for key, st in states.items():
        ix = large[key]
        block = OneSidedBlock(block_name(*key), ix, *onesided_sides(ix, max_factor_size))
        try:
            block.load_state_dict(st)
        except ValueError as err:
            raise refuse(who, str(err)) from None
        out[key] = block
    return out
