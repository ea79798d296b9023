"""The projection matmuls of ``nn.MultiheadAttention``, found in the autograd graph.

``F.multi_head_attention_forward`` projects queries, keys and values with one matmul per
distinct input (``in_proj_weight`` packed as ``[W_q; W_k; W_v]`` for self-attention, two
for key-is-value, three otherwise, or ``q/k/v_proj_weight`` with ``kdim``/``vdim``) and
the attention result with ``out_proj.weight``. Their saved left operands are the
projections' inputs ``a [T * N, D_in]`` (rows in ``(T, N)`` order, sequence first), and
a gradient edge on each of them gives the output gradient ``g [T * N, width]`` of that
matmul in the capture's one backward. This module finds those nodes:

* :func:`find_projections` walks the graph of a call's output down to the call's
  inputs and records, per found node, its *route* (positions in ``next_functions``);
* :func:`follow_routes` checks the routes of an earlier call on a new graph, which is
  cheaper than a walk when the module is called the same way again;
* :func:`projection_edges` turns the found nodes into the gradient edges to pull and,
  per edge, its saved input and the sub-layers (``q_proj``, ``k_proj``, ``v_proj``,
  ``out_proj``) whose output columns it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

#: The projections of ``nn.MultiheadAttention``, treated as Linear sub-layers.
SUBLAYERS = ("q_proj", "k_proj", "v_proj", "out_proj")

_MATMULS = ("MmBackward0", "AddmmBackward0")
_PASS_THROUGH = ("TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
_SPLITS = ("SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0")
_IN_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")

#: A weight operand: ``(parameter name, split index)``, the index of the chunk of a
#: split parameter (``in_proj_weight.chunk(3)``), else 0.
Hit = Tuple[str, int]
#: Where a node sits: its ``next_functions`` positions from the output's ``grad_fn``.
Route = Tuple[Tuple[int, ...], Hit]


@dataclass(frozen=True)
class ProjectionNodes:
    """The projection matmuls of one call of the module.

    Attributes:
        in_proj: ``(node, weight name, split index)`` per in-projection matmul.
        out_proj: The out-projection matmul node.
        routes: Per found node, its route and weight operand, for :func:`follow_routes`
            on a later call.

    """

    in_proj: List[Tuple[Any, str, int]]
    out_proj: Any
    routes: List[Route]


def find_projections(
    module: nn.MultiheadAttention, out: Tensor, inputs: Sequence[Tensor] = ()
) -> Optional[ProjectionNodes]:
    """The projection matmuls of one call, found by walking the autograd graph.

    The walk starts at the output and stops at the nodes that produced ``inputs`` (the
    call's query, key and value), so it covers this call's graph only: neither the rest
    of the model below the layer nor an earlier call of the same module.

    Args:
        module: The attention module.
        out: The call's attention output (the out-projection result behind it).
        inputs: The call's query, key and value tensors.

    Returns:
        The nodes, or ``None`` when the graph does not have the expected structure (no
        out-projection or no in-projection found; the rule then replays the module).

    """
    params = {id(p): n for n, p in module.named_parameters()}
    found_in, found_out, routes = [], None, []
    seen = _input_nodes(inputs)
    stack = [(out.grad_fn, ())]
    while stack:
        node, path = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = node.next_functions
        if type(node).__name__ in _MATMULS:
            for f, i in nexts:
                hit = _resolve(f, i, params)
                if hit is None:
                    continue
                if hit[0] == "out_proj.weight":
                    found_out = node
                    routes.append((path, hit))
                elif hit[0] in _IN_WEIGHTS:
                    found_in.append((node, hit[0], hit[1]))
                    routes.append((path, hit))
        for j, (f, _) in enumerate(nexts):
            if f is not None and type(f).__name__ != "AccumulateGrad":
                stack.append((f, path + (j,)))
    return _projections(found_in, found_out, routes)


def follow_routes(
    module: nn.MultiheadAttention, out: Tensor, inputs: Sequence[Tensor], routes: List[Route]
) -> Optional[ProjectionNodes]:
    """:func:`find_projections` along the routes found on an earlier call, or ``None``.

    Every node on a route must be outside the inputs' graph, and every end node must be
    a matmul whose weight operand is the same parameter (and split) as before; otherwise
    the graph changed and the caller walks it again.
    """
    params = {id(p): n for n, p in module.named_parameters()}
    stops = _input_nodes(inputs)
    found_in, found_out = [], None
    for path, expected in routes:
        node = out.grad_fn
        for j in path:
            if node is None or node in stops:
                return None
            nexts = node.next_functions
            if j >= len(nexts):
                return None
            node = nexts[j][0]
        if node is None or node in stops:
            return None
        if type(node).__name__ not in _MATMULS:
            return None
        if not any(_resolve(f, i, params) == expected for f, i in node.next_functions):
            return None
        if expected[0] == "out_proj.weight":
            found_out = node
        else:
            found_in.append((node, expected[0], expected[1]))
    return _projections(found_in, found_out, routes)


def projection_edges(module: nn.MultiheadAttention, found: ProjectionNodes) -> Optional[tuple]:
    """The gradient edges of the ``found`` matmuls, to pull with the call's outputs.

    An in-projection matmul of output width ``3E`` holds ``q_proj``, ``k_proj`` and
    ``v_proj`` (columns ``[0, E)``, ``[E, 2E)``, ``[2E, 3E)``), one of width ``2E``
    holds ``k_proj`` and ``v_proj``, one of width ``E`` the sub-layer of its split.

    Args:
        module: The attention module (embedding width ``E``).
        found: The call's projection matmuls.

    Returns:
        ``(edges, info)``: per matmul, ``(GradientEdge, (shape [T * N, width], dtype,
        device))`` in ``edges`` and ``(a [T * N, D_in], [(sub-layer, first column, end
        column)])`` in ``info``, the out-projection last; ``None`` unless the matmuls
        cover each of :data:`SUBLAYERS` exactly once.

    """
    E = module.embed_dim
    edges, info = [], []
    for node, weight, split in found.in_proj:
        a, width = _saved_input(node), _output_width(node)
        if a is None or width is None:
            return None
        if weight != "in_proj_weight":
            subs = [(weight[: -len("_weight")], 0, E)]  # q_proj_weight -> q_proj
        elif width == 3 * E:
            subs = [("q_proj", 0, E), ("k_proj", E, 2 * E), ("v_proj", 2 * E, 3 * E)]
        elif width == 2 * E:
            subs = [("k_proj", 0, E), ("v_proj", E, 2 * E)]
        elif width == E:
            subs = [(SUBLAYERS[:3][split], 0, E)]
        else:
            return None
        edges.append((GradientEdge(node, 0), ((a.shape[0], width), a.dtype, a.device)))
        info.append((a, subs))
    a_out = _saved_input(found.out_proj)
    if a_out is None:
        return None
    edges.append(
        (GradientEdge(found.out_proj, 0), ((a_out.shape[0], E), a_out.dtype, a_out.device))
    )
    info.append((a_out, [("out_proj", 0, E)]))
    names = [n for _, subs in info for n, _, _ in subs]
    if sorted(names) != sorted(SUBLAYERS):
        return None
    return edges, info


def _input_nodes(inputs: Sequence[Tensor]) -> set:
    """The autograd nodes that produced the call's inputs: where a walk must stop."""
    return {t.grad_fn for t in inputs if isinstance(t, Tensor) and t.grad_fn is not None}


def _projections(found_in: list, found_out, routes: List[Route]) -> Optional[ProjectionNodes]:
    """The result of a search, ``None`` without the out-projection or any in-projection."""
    if found_out is None or not found_in:
        return None
    return ProjectionNodes(found_in, found_out, routes)


def _resolve(fn, output_nr: int, params: Dict[int, str]) -> Optional[Hit]:
    """Follow single-input views/transposes/splits from ``fn`` to a parameter."""
    split = 0
    for _ in range(8):
        if fn is None:
            return None
        name = type(fn).__name__
        if name == "AccumulateGrad":
            p = params.get(id(fn.variable))
            return None if p is None else (p, split)
        if name in _SPLITS:
            split = output_nr
        elif name not in _PASS_THROUGH:
            return None
        nexts = [(f, i) for f, i in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return None
        fn, output_nr = nexts[0]
    return None


def _output_width(node) -> Optional[int]:
    """The last dimension of a node's (forward) output, from its input metadata."""
    try:
        return int(node._input_metadata[0].shape[-1])
    except (AttributeError, IndexError, TypeError):
        return None


def _saved_input(node) -> Optional[Tensor]:
    """The left operand ``a`` saved by a matmul node (``a @ W^T``)."""
    for attr in ("_saved_mat1", "_saved_self"):
        t = getattr(node, attr, None)
        if isinstance(t, Tensor):
            return t
    return None
