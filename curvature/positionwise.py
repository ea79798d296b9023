"""Position-wise models: per-position losses with the positions folded into the batch.

A model is *position-wise* when each output position depends on the input at the same
position only: ``f(X)[n, t] = f_0(X[n, t])`` for every position ``t`` of
``X [N, *pos, D]`` (``P = prod(pos)`` positions), the same ``f_0`` and parameters at
every position. With a loss that is a sum (or mean) over positions, the GGN is then
block-diagonal over ``(n, t)`` in output space,

    GGN = sum_{n,t} J_nt^T H_nt J_nt,    diag(GGN) = sum_{n,t,c} (J_nt^T s_ntc)^2,

with ``s_ntc`` the ``C`` columns of the loss Hessian's square root at ``(n, t)``, and
``L(theta)`` is the same function of the parameters when the model is applied to the
``N P`` positions as samples ``[N P, D]``. :func:`fold_positions` makes that batch, so
that the type-2 diagonal pulls ``C`` vectors of ``N P C`` entries instead of ``C P``
vectors (each column on one position at a time, the block-diagonal loss Hessian's
square root over ``[N, *pos, C]``): ``P`` times fewer vectors and backward work, the
same numbers up to rounding.

Which models are position-wise is decided from their structure only, never guessed: an
``nn.Sequential`` (nested ``nn.Sequential`` allowed), of these exact module types (no
subclass, no instance ``forward``, no module or global forward or backward hooks):

- features last (``X [N, *pos, D]``, outputs ``[N, *pos, C]``): ``nn.Linear``,
  ``nn.LayerNorm`` / ``nn.RMSNorm`` over the last axis; with ``nn.MSELoss`` or
  ``nn.BCEWithLogitsLoss`` (``weight`` / ``pos_weight`` at most 1-D, over the features);
- channels first (``X [N, D, *pos]``, outputs ``[N, C, *pos]``): ``nn.Conv1d`` /
  ``nn.Conv2d`` / ``nn.Conv3d`` with kernel size 1, stride 1 and no padding; with
  ``nn.CrossEntropyLoss`` (class or probability targets), ``nn.MSELoss`` or
  ``nn.BCEWithLogitsLoss`` without ``weight`` / ``pos_weight``;
- in both: parameter-free elementwise activations, ``nn.Dropout`` and ``nn.Identity``.

Anything else (attention, convolutions over the positions, recurrent layers, a custom
module, a reshape) may mix positions and keeps the exact path with ``C P`` vectors.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from torch import Tensor, nn
from torch.nn.modules import module as torch_module

Batch = Tuple[Tensor, Tensor]

#: Parameter-free modules that act on every entry alone (their exact types).
ELEMENTWISE = frozenset(
    {
        nn.Identity,
        nn.Dropout,
        nn.ReLU,
        nn.ReLU6,
        nn.LeakyReLU,
        nn.ELU,
        nn.CELU,
        nn.SELU,
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Tanh,
        nn.Sigmoid,
        nn.Softplus,
        nn.Softsign,
        nn.Tanhshrink,
        nn.Hardtanh,
        nn.Hardsigmoid,
        nn.Hardswish,
        nn.LogSigmoid,
    }
)
_NORMS = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)
_CONVS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _hooked(module: nn.Module) -> bool:
    """Whether a hook or an instance ``forward`` could change what ``module`` computes."""
    # torch internals: torch has no public way to list a module's hooks
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    return any(hooks) or "forward" in vars(module)


def _global_hooks() -> bool:
    """Whether global module hooks are registered (they see every module's call)."""
    # torch internals: torch has no public way to list the global module hooks
    return any(
        (
            torch_module._global_forward_hooks,
            torch_module._global_forward_pre_hooks,
            torch_module._global_backward_hooks,
            torch_module._global_backward_pre_hooks,
        )
    )


def _leaf_layout(module: nn.Module) -> Optional[str]:
    """``"any"`` (elementwise), ``"last"``, ``"conv{k}"`` or ``None`` (may mix positions)."""
    kind = type(module)
    if kind in ELEMENTWISE:
        return "any"
    if kind is nn.Linear:
        return "last"
    if kind in _NORMS:
        return "last" if len(module.normalized_shape) == 1 else None
    if kind in _CONVS:
        padding = module.padding
        pointwise = (
            all(k == 1 for k in module.kernel_size)
            and all(s == 1 for s in module.stride)
            and (padding in ("valid", "same") or all(p == 0 for p in padding))
        )
        return f"conv{_CONVS[kind]}" if pointwise else None
    return None


def model_layout(model: nn.Module) -> Optional[str]:
    """The axis layout of a position-wise model, else ``None`` (see the module docstring).

    Returns:
        ``"last"`` (features on the last axis), ``"conv1"`` / ``"conv2"`` / ``"conv3"``
        (channels on axis 1, that many position axes), or ``None`` where the structure
        does not show that positions never mix (or no layer has parameters).

    """
    if type(model) is not nn.Sequential or _global_hooks():
        return None
    layouts = set()
    for m in model.modules():
        if _hooked(m):
            return None
        if type(m) is nn.Sequential:
            continue
        kind = _leaf_layout(m)
        if kind is None:
            return None
        layouts.add(kind)
    layouts.discard("any")
    return layouts.pop() if len(layouts) == 1 else None


def _fold(t: Tensor, channels_first: bool, ones: int) -> Tensor:
    """``[N, *pos, D] -> [N P, D]`` or ``[N, D, *pos] -> [N P, D, 1, ...]`` (``ones`` ones)."""
    if channels_first:
        t = t.movedim(1, -1)
    N, D = t.shape[0], t.shape[-1]
    P = math.prod(t.shape[1:-1])
    return t.reshape(N * P, D, *[1] * ones) if channels_first else t.reshape(N * P, D)


def _fold_batch(layout: str, loss_func: nn.Module, X, y) -> Optional[Tuple[Batch, int]]:
    """The batch with its positions as samples and ``P``, or ``None`` where it cannot be."""
    if not isinstance(X, Tensor) or not isinstance(y, Tensor) or not X.is_floating_point():
        return None
    if layout == "last":
        if isinstance(loss_func, nn.CrossEntropyLoss) or X.dim() < 3:
            return None
        if y.dim() != X.dim() or y.shape[:-1] != X.shape[:-1]:
            return None
        if isinstance(loss_func, nn.BCEWithLogitsLoss) and any(
            w is not None and w.dim() > 1 for w in (loss_func.weight, loss_func.pos_weight)
        ):
            return None
        return (_fold(X, False, 0), _fold(y, False, 0)), math.prod(X.shape[1:-1])
    k = int(layout[-1])
    if X.dim() != 2 + k:
        return None
    pos = X.shape[2:]
    P = math.prod(pos)
    if isinstance(loss_func, nn.CrossEntropyLoss) and not y.is_floating_point():
        if y.shape != X.shape[:1] + pos:  # class targets [N, *pos]
            return None
        return (_fold(X, True, k), y.reshape(X.shape[0] * P, *[1] * k)), P
    if isinstance(loss_func, nn.BCEWithLogitsLoss) and (
        loss_func.weight is not None or loss_func.pos_weight is not None
    ):
        return None
    if y.dim() != X.dim() or y.shape[0] != X.shape[0] or y.shape[2:] != pos:
        return None
    return (_fold(X, True, k), _fold(y, True, k)), P


def fold_positions(
    model: nn.Module, loss_func: nn.Module, batches: Sequence[Batch]
) -> Tuple[List[Batch], bool]:
    """The batches with the positions of a position-wise model folded into the samples.

    ``X [N, *pos, D] -> [N P, D]`` and the targets alike (channels first: ``X [N, D,
    *pos] -> [N P, D, 1, ...]``, class targets ``[N, *pos] -> [N P, 1, ...]``). The loss
    module's scalar is unchanged (a mean runs over the same ``N P C`` elements, or ``N P``
    CrossEntropy positions), and so is every batch's weight in the union of the batches
    (the batches are folded only if they have the same ``P`` or the loss is a sum).

    Args:
        model: The model; folded only if :func:`model_layout` is not ``None``.
        loss_func: A supported loss module.
        batches: ``(X, y)`` pairs.

    Returns:
        ``(batches, folded)``: the folded batches and ``True``, or the batches unchanged
        and ``False`` where the model or a batch does not allow it (or has one position).

    """
    layout = model_layout(model)
    folded = [] if layout is None else [_fold_batch(layout, loss_func, X, y) for X, y in batches]
    if not folded or any(f is None for f in folded):
        return list(batches), False
    sizes = {P for _, P in folded}
    if sizes == {1} or (loss_func.reduction == "mean" and len(sizes) > 1):
        return list(batches), False
    return [b for b, _ in folded], True
