"""The interface every layer rule implements, and the shared maths of linear layers.

A *call* is one invocation of a module inside a captured forward pass: its positional
and keyword inputs, and (after a backward pull) the gradients ``g`` of the pulled
scalar w.r.t. each of its tensor outputs. A *rule* turns the calls of one module into
per-sample quantities of the module's trainable parameters.

Symbols used across the package: ``a`` (layer input), ``g`` (gradient w.r.t. the
layer output), ``N`` (batch), ``S`` (shared positions), ``G`` (groups).
"""

from __future__ import annotations

import contextvars
import math
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .kfac_sums import expanded_kfac
from .plain import PlainOperands, plain_kfac

#: Upper bound (in elements) for temporaries created while computing norms and Gram
#: matrices; work is chunked over the batch so that no temporary exceeds it.
CHUNK_ELEMENTS = 2**24

#: The number ``n`` of stacked slots of the layer calls in progress (see
#: :func:`shared_slots`), ``None`` outside such a call. Read it with
#: :func:`current_shared_slots`.
SHARED_SLOTS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "SHARED_SLOTS", default=None
)


@contextmanager
def shared_slots(n: int) -> Iterator[None]:
    """Mark the layer calls inside as weight sharing over ``n`` stacked slots on axis 1.

    A caller that pushes a stack of ``n`` related inputs ``[N, n, *F_in]`` through a
    layer at once (the same weights on every slot) says so with this context; the
    capture engine records ``n`` as :attr:`Call.slots` of every call made inside, and the
    linear-family rules treat the slots as shared positions ``S`` of which only slot 0
    carries the bias: the bias coordinate of the expanded input is 1 on slot 0 and 0 on
    slots ``1..n-1`` (the caller removes the bias from those slots itself). The forward
    Laplacian is one user: its state stacks the value, the ``d`` first derivatives and
    the Laplacian (``n = d + 2``).

    The context nests (the innermost ``n`` holds) and is reset on exit, also when a
    layer raises; it is a ``contextvars.ContextVar``, so threads and tasks do not see
    each other's.

    Example:
        >>> with shared_slots(state.shape[1]):
        ...     out = linear(state)  # hooks see current_shared_slots() == state.shape[1]

    Args:
        n: The number of slots (a positive integer).

    Raises:
        ValueError: If ``n`` is not a positive integer.

    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"shared_slots(n={n!r}): n must be a positive integer (slots).")
    token = SHARED_SLOTS.set(n)
    try:
        yield
    finally:
        SHARED_SLOTS.reset(token)


def current_shared_slots() -> Optional[int]:
    """The ``n`` of the innermost :func:`shared_slots` in progress, else ``None``."""
    return SHARED_SLOTS.get()


#: Whether a rule replays a module's forward now (the ``torch.func`` fallback); the
#: engine's own hooks (layer records, an optimizer's forward callbacks) do nothing then.
REPLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar("REPLAYING", default=False)


@contextmanager
def replaying() -> Iterator[None]:
    """Mark a replay of a module's forward: the engine's hooks ignore the calls inside.

    A module replayed per sample may be the model itself (a root module with direct
    parameters, e.g. a 0-dim ``scale``): its forward hooks must not start a curvature
    backward or record calls in the middle of the replay.
    """
    token = REPLAYING.set(True)
    try:
        yield
    finally:
        REPLAYING.reset(token)


@dataclass(eq=False)
class Call:
    """One invocation of a module recorded during a captured forward.

    Attributes:
        args: Positional inputs of the call.
        kwargs: Keyword inputs of the call.
        versions: ``_version`` counters of the tensor inputs at record time, to detect
            later in-place modification.
        out_edges: Gradient edges of the tensor outputs that require grad; they point at
            the node that produced each output, so in-place ops applied to the output
            afterwards do not change which gradient we receive.
        out_meta: ``(shape, dtype, device)`` of each output behind ``out_edges``.
        out_index: Position of each recorded output in the flattened output structure.
        grads: Gradients w.r.t. the recorded outputs after a pull, one per output
            (with a leading ``[K]`` axis for batched pulls), else ``None``.
        outputs: The recorded outputs themselves, kept only for rules that set
            ``needs_outputs`` (to verify a replay), else ``None``.
        slots: The number ``n`` of stacked slots on axis 1 (weight sharing, the bias on
            slot 0 only) when the call ran inside :func:`shared_slots`, else ``None``.
        tickets: For a call recorded in a ``torch.compile``'d forward
            (:mod:`curvature.capture_traced`): the serial number of each output's tap,
            which stands in for its edge (``out_edges`` is then empty); else ``None``.
        pulled: The gradients the taps handed over during a pull in progress.

    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    versions: List[Tuple[Tensor, int]]
    out_edges: List[Any]
    out_meta: List[Tuple[torch.Size, torch.dtype, torch.device]]
    out_index: List[int]
    grads: Optional[List[Tensor]] = field(default=None, repr=False)
    outputs: Optional[List[Tensor]] = field(default=None, repr=False)
    output_versions: Optional[List[int]] = field(default=None, repr=False)
    #: ``(grads, operands)``: a rule's plain operands of this call for the ``grads`` list
    #: they were made from (reused by the statistics of one step; see ``plain_operands``).
    plain: Optional[Tuple[Any, Any]] = field(default=None, repr=False)
    #: ``(grads, blocks)``: a rule's ``expanded_blocks`` of this call alone, as ``plain``.
    expanded: Optional[Tuple[Any, Any]] = field(default=None, repr=False)
    out_views: List[Any] = field(default_factory=list, repr=False)
    pushed: Optional[List[Optional[Tensor]]] = field(default=None, repr=False)
    pending: Optional[List[Optional[Tensor]]] = field(default=None, repr=False)
    slots: Optional[int] = None
    extra_info: Any = field(default=None, repr=False)
    tickets: Optional[List[int]] = field(default=None, repr=False)
    pulled: Optional[List[Optional[Tensor]]] = field(default=None, repr=False)
    #: ``(serial, N)``: the optimizer's training forward that recorded the call and axis 0
    #: of that forward's model output (``None`` when not a tensor); set by its collector.
    forward: Optional[Tuple[int, Optional[int]]] = field(default=None, repr=False)
    #: The autograd graph task (backward pass) whose gradients ``pending`` holds.
    task: int = field(default=-1, repr=False)
    #: A ``create_graph=True`` pass reached the call (its gradients have a graph).
    graphed: bool = field(default=False, repr=False)

    def check_inputs_unchanged(self, module_name: str) -> None:
        """Raise if an input tensor was modified in place after it was recorded."""
        for t, v in self.versions:
            if t._version != v:
                raise RuntimeError(
                    f"The input of module '{module_name}' was modified in place after the "
                    "module consumed it, so its recorded value is no longer the one the "
                    "forward used. Avoid in-place ops (e.g. `x += ...`, `relu_`) on layer "
                    "inputs, or clone the input before the in-place op."
                )


class LayerRule:
    """Per-sample maths of one layer family.

    Subclasses implement :meth:`per_sample_grads`; :meth:`per_sample_sq_norms` and
    :meth:`gram` default to reductions of the materialized per-sample gradients and are
    overridden where a cheaper route exists.
    """

    #: Whether the rule also covers the parameters of the module's children.
    covers_children: bool = False
    #: Whether calls keep references to the module's outputs (see ``Call.outputs``).
    needs_outputs: bool = False
    #: Outputs (flattened positions) that, when views, are the only use of their base
    #: tensor, so the base's gradient edge can stand in for theirs (survives in-place ops).
    base_edge_outputs: Tuple[int, ...] = ()
    #: Whether :meth:`extra_edges` only saves work (the rule is exact without them): a
    #: ``torch.compile``'d forward then records the layer without them, in the graph.
    extra_edges_optional: bool = False

    def param_names(self, module: nn.Module) -> List[str]:
        """Names (relative to ``module``) of the trainable parameters the rule covers."""
        params = module.named_parameters(recurse=self.covers_children)
        return [name for name, p in params if p.requires_grad]

    def extra_edges(self, module: nn.Module, args, kwargs, leaves, index) -> Optional[list]:
        """Gradient edges of internal tensors to pull besides the outputs (at record time).

        Returns ``([(edge, (shape, dtype, device)), ...], info)``: the gradients follow the
        outputs' in ``call.grads`` and ``info`` is kept as ``call.extra_info``. ``None`` by
        default.
        """
        return None

    def batch_size(self, module: nn.Module, call: Call) -> int:
        """Size of the batch axis of a call (axis 0 of the first input by default)."""
        return call.args[0].shape[0]

    def per_sample_grads(
        self,
        module: nn.Module,
        calls: Sequence[Call],
        out: Optional[Dict[str, Tensor]] = None,
    ) -> Dict[str, Tensor]:
        """Per-sample gradients ``[N, *p.shape]`` summed over the calls.

        Args:
            module: The layer.
            calls: Its recorded calls, with ``grads`` filled by a (non-batched) pull.
            out: Optional preallocated results (same keys); rules may write into them,
                the caller copies results that are not.

        Returns:
            Map from the names of :meth:`param_names` to per-sample gradients.

        """
        raise NotImplementedError

    def per_sample_sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        """Squared L2 norms ``[N]`` of the per-sample gradients of all covered params."""
        grads = self.per_sample_grads(module, calls)
        return sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values())

    def gram(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        """Gram matrix ``[N, N]`` of the per-sample gradients of all covered params."""
        return gram_of(self.per_sample_grads(module, calls))

    # -- Kronecker factors ---------------------------------------------------------------
    def expanded_blocks(
        self, module: nn.Module, calls: Sequence[Call]
    ) -> Optional[Dict[str, Tuple[Tensor, Tensor]]]:
        """Linear sub-layers as ``{suffix: (a [N, S, C, D], g [..., N, S, C, D_out])}``.

        ``a`` includes the bias column when the bias is trainable. ``None`` for layers
        without linear structure.
        """
        return None

    def permuted_blocks(self, module: nn.Module, calls: Sequence[Call]) -> Optional[dict]:
        """:meth:`expanded_blocks` with ``a``'s columns in a cheaper order, ``{suffix: (a, g,
        order)}``: ``a[..., j]`` is their ``a[..., order[j]]``. ``None``: no such order.
        """
        return None

    def expanded_shape(
        self, module: nn.Module, calls: Sequence[Call]
    ) -> Optional[Tuple[int, int, int, int, int]]:
        """``(N, S, C, D, D_out)`` of the one block of :meth:`expanded_blocks` without
        forming it, where the rule can tell and the block is worth cutting into chunks of
        samples (unfolded convolution patches); ``None`` otherwise (the default).

        A rule that gives it reads only the first input and output gradient of each call,
        samples along their first axis (after the gradients' leading ``[K]``).
        """
        return None

    def kfac_factors(
        self, module: nn.Module, calls: Sequence[Call], approx: str, with_g: bool = True
    ) -> Optional[Dict[str, Tuple[Tensor, Optional[Tensor], int]]]:
        """Kronecker statistics per block: ``{suffix: (A_sum, G_sum, count)}``.

        ``A_sum [C, D, D]``, ``G_sum [C, D_out, D_out]``; the suffix names the block inside
        the module (``""`` for the module itself, e.g. ``"q_proj"`` for attention).
        ``A = A_sum / count``; ``G_sum`` sums ``g g^T`` over the pulled vectors, samples
        (and shared positions for ``"expand"``). ``None`` when the layer has no Kronecker
        structure: its block is then the exact block ``sum vec(grad) vec(grad)^T``.
        ``with_g=False`` skips ``G`` (forward-only Fisher). A rule of one's own may return
        tensors it keeps (the optimizers then never write them; the built-in rules' sums
        are new tensors, zeroed in place when a step's statistics are not finite).
        """
        blocks = self.expanded_blocks(module, calls)
        if blocks is None:
            return None
        return {k: expanded_kfac(a, g if with_g else None, approx) for k, (a, g) in blocks.items()}

    def kfac_index(
        self, module: nn.Module, offsets: Dict[str, int], device=None
    ) -> Optional[Dict[str, Tensor]]:
        """Per block suffix, ``[C, D_out, D]`` positions of the entries in the flat vector.

        Entry ``(c, o, i)`` of the layer's matrix ``[W | b]`` (group ``c``) sits at
        ``index[c, o, i]``, so that the block ``kron(G_c, A_c)`` acts on ``vec_row``.
        Built on ``device`` (default: the default device). A rule of one's own may leave
        ``device`` out of its signature: :func:`curvature.layer_stats.block_index` then
        builds its index inside a ``torch.device`` context.
        """
        return None

    def live_columns(self, module: nn.Module, calls: Sequence[Call]) -> Optional[Tuple[int, ...]]:
        """Columns of ``A`` (block ``""``) that ``calls`` can fill, by shape; ``None``: all."""
        return None

    def kfac_shapes(self, module: nn.Module) -> Optional[Dict[str, Tuple[int, int, int]]]:
        """Per block suffix, ``(C, D_out, D)``: the shapes of :meth:`kfac_index`'s tensors.

        Without building them (the factor sizes before the statistics); ``None`` where
        :meth:`kfac_index` is. This default builds the index on the ``meta`` device (no
        data) with every offset 0; the built-in rules compute the shapes directly.
        """
        with torch.device("meta"):
            index = self.kfac_index(module, defaultdict(int))
        return None if index is None else {s: tuple(ix.shape) for s, ix in index.items()}


def check_same_samples(module: nn.Module, sizes: Sequence[int]) -> None:
    """Several calls of one layer in a forward share its per-sample statistics (weight
    sharing over their positions): every call must hold the same samples.
    """
    if len(set(sizes)) > 1:
        raise ValueError(
            f"{type(module).__name__} is called {len(sizes)} times in one forward on batches "
            f"of different sizes {list(sizes)}: its per-sample statistics need every call's "
            "rows to be the loss's samples, and a batch shared by all of them (a support set "
            "beside the query batch, say) is not. Freeze its parameters "
            "(requires_grad_(False)) to train the rest with curvature."
        )


def gram_of(grads: Dict[str, Tensor]) -> Tensor:
    """``sum_p P_p P_p^T`` for per-sample gradients ``P_p [N, *p.shape]`` (no concatenation)."""
    total = None
    for g in grads.values():
        flat = g.reshape(g.shape[0], -1)
        total = flat @ flat.T if total is None else total.addmm_(flat, flat.T)
    return total


def _buffer(
    out: Optional[Dict[str, Tensor]], key: str, shape: Tuple[int, ...], like: Tensor
) -> Tensor:
    """``out[key]`` if given, else a new uninitialized tensor like ``like`` (dtype, device)."""
    if out is not None and key in out:
        return out[key]
    return like.new_empty(shape)


def _sum_into(t: Tensor, dim: int, target: Tensor) -> None:
    """``target[...] = t.sum(dim)``, without a temporary when the dtypes agree."""
    if t.dtype == target.dtype:
        torch.sum(t, dim, out=target)
    else:
        target.copy_(t.sum(dim))


class LinearFamilyRule(LayerRule):
    """Rules for layers whose weight acts as a matrix on (unfolded) inputs.

    Such a layer computes, for sample ``n``, shared position ``s`` and group ``c``,
    ``z[n, s, c] = W_c a[n, s, c] + b_c`` with ``W_c`` of shape ``[D_out, D_in]``. Its
    per-sample gradient is ``sum_s g[n, s, c] a[n, s, c]^T`` (the bias appended as a last
    input coordinate equal to 1). Subclasses only provide :meth:`expand`: everything
    else (gradients, norms, Gram matrices, and later Kronecker factors) is shared.
    """

    def expand(self, module: nn.Module, call: Call) -> Tuple[Tensor, Tensor]:
        """Return ``(a [N, S, G, D_in], g [..., N, S, G, D_out])`` of one call.

        ``g`` carries the leading axes of ``call.grads`` (``[K]`` for batched pulls);
        it is ``None`` when no backward ran (forward-only statistics). ``a`` is the raw
        input (bias column not appended).
        """
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------
    @staticmethod
    def _weight_bias(module: nn.Module) -> Tuple[bool, bool]:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        return weight is not None and weight.requires_grad, bias is not None and bias.requires_grad

    @staticmethod
    def bias_column(call: Call, a: Tensor) -> Tensor:
        """The bias coordinate ``[N, S, C, 1]`` of the expanded input.

        1 everywhere, except for a call made inside :func:`shared_slots` (``call.slots``
        set), where the bias acts on slot 0 only: 1 on slot 0 and 0 on the other slots
        (in a forward Laplacian: the value slot, not the derivative slots).
        """
        if call.slots is None:
            return cached_ones(a.shape[:-1] + (1,), a.dtype, a.device)
        col = a.new_ones(*a.shape[:-1], 1)  # (calls inside shared_slots)
        col = col.view(a.shape[0], -1, call.slots, *a.shape[2:-1], 1).clone()
        col[:, :, 1:] = 0
        return col.view(*a.shape[:-1], 1)

    def expand_calls(self, module: nn.Module, calls: Sequence[Call]) -> Tuple[Tensor, Tensor]:
        """Expanded inputs with trainable columns, all calls concatenated along ``S``.

        Returns:
            ``a [N, S, G, D]`` with ``D = D_in`` (weight trainable) ``+ 1`` (bias
            trainable), and ``g [..., N, S, G, D_out]``. Several calls of one module act
            like weight sharing over the concatenated positions.

        """
        has_w, has_b = self._weight_bias(module)
        a_list, g_list = [], []
        for call in calls:
            a, g = self.expand(module, call)
            if g is not None and a.dtype != g.dtype:  # e.g. bf16 inputs under autocast
                a = a.to(torch.promote_types(a.dtype, g.dtype))
            parts = [a] if has_w else []
            if has_b:
                parts.append(self.bias_column(call, a))
            a_list.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
            g_list.append(g)
        if len(calls) == 1:
            return a_list[0], g_list[0]
        check_same_samples(module, [a.shape[0] for a in a_list])
        g_cat = None if g_list[0] is None else torch.cat(g_list, dim=-3)
        return torch.cat(a_list, dim=1), g_cat

    # -- per-sample quantities ---------------------------------------------------------
    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        res: Dict[str, Tensor] = {}
        for i, call in enumerate(calls):
            a, g = self.expand(module, call)  # [N, S, C, D_in], [N, S, C, D_out]
            N, S, C, D_in = a.shape
            D_out = g.shape[-1]
            if has_w:
                if i == 0:
                    res["weight"] = _buffer(out, "weight", (N, *module.weight.shape), g)
                target = res["weight"].view(N, C, D_out, D_in)
                # sum_s g[n, s, c] a[n, s, c]^T, written in place (no [N, ...] temporaries)
                if S == 1:
                    g1, a1 = g[:, 0, :, :, None], a[:, 0, :, None, :]
                    if i == 0:
                        torch.mul(g1, a1, out=target)
                    else:
                        target.addcmul_(g1, a1)
                else:
                    # as in materialize(): "n s c o -> (n c) o s", "n s c i -> (n c) s i"
                    gt = g.permute(0, 2, 3, 1).reshape(N * C, D_out, S)
                    at = a.permute(0, 2, 1, 3).reshape(N * C, S, D_in)
                    flat = target.view(N * C, D_out, D_in)
                    if i == 0:
                        torch.bmm(gt, at, out=flat)
                    else:
                        flat.baddbmm_(gt, at)
            if has_b:
                # sum_s g[n, s, c] (times the bias column in a forward Laplacian)
                gb = g if call.slots is None else g * self.bias_column(call, a)
                if i == 0:
                    res["bias"] = _buffer(out, "bias", (N, *module.bias.shape), g)
                    _sum_into(gb, 1, res["bias"].view(N, C, D_out))
                else:
                    res["bias"].view(N, C, D_out).add_(gb.sum(1))
        return res

    def per_sample_sq_norms(self, module, calls):  # noqa: D102
        return expanded_sq_norms(*self.expand_calls(module, calls))

    def gram(self, module, calls):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        a, g = self.expand(module, calls[0])  # for the shapes (views for Linear)
        N, S, _, D_in = a.shape
        S, D, D_out = S * len(calls), D_in * has_w + has_b, g.shape[-1]
        if S > 1 and not _pairs_cheaper(N, S, D, D_out):
            # materialize with the per-sample gradient products: no bias-column copy
            return gram_of(self.per_sample_grads(module, calls))
        return expanded_gram(*self.expand_calls(module, calls))

    # -- Kronecker factors -----------------------------------------------------------
    def expanded_blocks(self, module, calls):  # noqa: D102
        return {"": self.expand_calls(module, calls)}

    def plain_operands(self, module: nn.Module, calls: Sequence[Call]) -> Optional[PlainOperands]:
        """One group's inputs and gradients as matrices (:mod:`~curvature.layers.plain`).

        ``None`` (the default) where the layer has several groups or calls: the general
        paths over :meth:`expand_calls` handle it.
        """
        return None

    def kfac_factors(self, module, calls, approx, with_g=True):  # noqa: D102
        ops = self.plain_operands(module, calls) if approx == "expand" else None
        if ops is None:
            return super().kfac_factors(module, calls, approx, with_g)
        A_sum, G_sum = plain_kfac(ops if with_g else PlainOperands(ops.a, None, ops.positions))
        return {"": (A_sum, G_sum, ops.a.shape[1])}

    def kfac_index(self, module, offsets, device=None):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        out, in_eff, C = self._matrix_shape(module)
        cols = []  # [out, in_eff] weight positions, row-major; [out, 1] bias positions
        if has_w:
            start = offsets["weight"]
            w = torch.arange(start, start + out * in_eff, device=device)
            cols.append(w.view(out, in_eff))
        if has_b:
            b = torch.arange(offsets["bias"], offsets["bias"] + out, device=device)
            cols.append(b.view(out, 1))
        index = torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]  # [out, D]
        return {"": index.view(C, out // C, index.shape[1])}

    def kfac_shapes(self, module):  # noqa: D102
        if type(self).kfac_index is not LinearFamilyRule.kfac_index:  # a subclass's own index
            return super().kfac_shapes(module)
        has_w, has_b = self._weight_bias(module)
        out, in_eff, C = self._matrix_shape(module)
        return {"": (C, out // C, in_eff * has_w + has_b)}

    @staticmethod
    def _matrix_shape(module: nn.Module) -> Tuple[int, int, int]:
        """``(D_out, D_in, C)``: rows and (unfolded) input columns of the weight, groups."""
        ref = module.weight if module.weight is not None else module.bias
        out = ref.shape[0]
        in_eff = math.prod(module.weight.shape[1:]) if module.weight is not None else 0
        return out, in_eff, getattr(module, "groups", 1)


# -- maths on expanded inputs a [N, S, C, D] (bias column included) and g [..., N, S, C, D_out]
def expanded_sq_norms(a: Tensor, g: Tensor) -> Tensor:
    """Squared norms ``[N]`` of ``sum_s g[n, s, c] a[n, s, c]^T`` over ``c`` and entries."""
    N, S, C, D = a.shape
    D_out = g.shape[-1]
    if S == 1:
        return (a.pow(2).sum(-1) * g.pow(2).sum(-1)).sum((1, 2))
    # Gram trick over positions: sum_{s,t} (a_s . a_t)(g_s . g_t), cost S^2 (D + D_out)
    # per sample and group, versus D D_out (S + 1) to materialize the gradient.
    if S * S * (D + D_out) <= (S + 1) * D * D_out:
        chunk = max(1, CHUNK_ELEMENTS // max(1, S * S * C))
        out = []
        for i in range(0, N, chunk):
            aa = torch.einsum("nsci,ntci->ncst", a[i : i + chunk], a[i : i + chunk])
            gg = torch.einsum("nsco,ntco->ncst", g[i : i + chunk], g[i : i + chunk])
            out.append((aa * gg).sum((1, 2, 3)))
        return torch.cat(out)
    chunk = max(1, CHUNK_ELEMENTS // max(1, C * D * D_out))
    out = []
    for i in range(0, N, chunk):
        grad = materialize(a[i : i + chunk], g[i : i + chunk])
        out.append(grad.pow(2).sum((1, 2, 3)))
    return torch.cat(out)


def expanded_gram(a: Tensor, g: Tensor) -> Tensor:
    """Gram matrix ``[N, N]`` of the per-sample gradients ``sum_s g a^T``."""
    N, S, C, D = a.shape
    D_out = g.shape[-1]
    if S == 1:
        a2, g2 = a[:, 0], g[:, 0]  # [N, C, D], [N, C, D_out]
        aa = torch.einsum("nci,mci->cnm", a2, a2)
        gg = torch.einsum("nco,mco->cnm", g2, g2)
        return (aa * gg).sum(0)
    if _pairs_cheaper(N, S, D, D_out):
        out = a.new_zeros(N, N)
        chunk = max(1, CHUNK_ELEMENTS // max(1, N * S * S * C))
        for i in range(0, N, chunk):
            aa = torch.einsum("nsci,mtci->nmcst", a[i : i + chunk], a)
            gg = torch.einsum("nsco,mtco->nmcst", g[i : i + chunk], g)
            out[i : i + chunk] = (aa * gg).sum((2, 3, 4))
        return out
    flat = materialize(a, g).reshape(N, -1)
    return flat @ flat.T


def _pairs_cheaper(N: int, S: int, D: int, D_out: int) -> bool:
    """Whether the Gram matrix over pairs of positions beats materializing the gradients.

    Pairwise positions cost ``N^2 S^2 (D + D_out)`` per group, materializing
    ``N D D_out (S + N)``.
    """
    return N * S * S * (D + D_out) <= (S + N) * D * D_out


def materialize(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample gradients ``sum_s g[n, s, c] a[n, s, c]^T`` as ``[N, C, D_out, D]``.

    One batched GEMM over ``N C`` with the position axis contracted (faster than the
    equivalent ``einsum``, which may copy its operands). The operands are ``g: "n s c o ->
    (n c) o s"`` and ``a: "n s c i -> (n c) s i"`` (einops' notation), written with
    ``permute``/``reshape``: ``einops.rearrange``'s Python cost 4% of a per-sample-gradient
    call on tiny tensors (a 16-32-10 MLP over ``[32, 12, 16]``).
    """
    N, S, C, D = a.shape
    D_out = g.shape[-1]
    gt = g.permute(0, 2, 3, 1).reshape(N * C, D_out, S)  # [N C, D_out, S]
    at = a.permute(0, 2, 1, 3).reshape(N * C, S, D)  # [N C, S, D]
    return torch.bmm(gt, at).view(N, C, D_out, D)


_ONES: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], Tensor] = {}


def cached_ones(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A ones tensor, allocated once per shape, dtype and device (read only: never written)."""
    key = (tuple(shape), dtype, device)
    if key not in _ONES:
        if len(_ONES) > 32:  # many batch shapes: start over
            _ONES.clear()
        _ONES[key] = torch.ones(key[0], dtype=dtype, device=device)
    return _ONES[key]
