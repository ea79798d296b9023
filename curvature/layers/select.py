"""Which layers of a model are covered, and by which rule (the registry's view of a model)."""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple, Union

from torch import nn
from torch.nn.utils import parametrize

from ..options import Unsupported, choice
from .base import LayerRule
from .functional import FunctionalRule
from .norm import batchnorm_train_error, uses_batch_statistics
from .registry import registered_rule

_FUNCTIONAL = FunctionalRule()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel wrappers and ``torch.compile``'s wrapper.

    Layer names are then those of the plain model (not ``_orig_mod.<name>``); calling the
    compiled wrapper runs the inner model's hooks. ``torch.compile`` imports dynamo.
    """
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif dynamo is not None and isinstance(model, dynamo.OptimizedModule):
            model = model._orig_mod  # the compiled model (no public accessor)
        else:
            return model


def compiled_wrapper(model: nn.Module) -> Optional[nn.Module]:
    """``torch.compile``'s wrapper of the user's model (inside DDP wrappers), else ``None``.

    Its own hooks run outside the compiled region: the capture's forward callbacks go
    there, so that they split no graph.
    """
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif dynamo is not None and isinstance(model, dynamo.OptimizedModule):
            return model
        else:
            return None


def select_layers(
    model: nn.Module,
    unsupported: Union[str, Unsupported] = "functorch",
    *,
    arg: str = "unsupported",
    skip_batch_statistics: bool = False,
) -> List[Tuple[str, nn.Module, LayerRule]]:
    """The layers that carry trainable parameters, each with the rule that covers it.

    Args:
        model: The model.
        unsupported: ``"functorch"`` covers parameterized layers without a registered
            rule with the ``torch.func`` replay; ``"error"`` refuses them.
        arg: The argument's name as the user wrote it (for the error message).
        skip_batch_statistics: Leave out BatchNorm layers that normalize with batch
            statistics instead of refusing them (the optimizers: the statistics of the
            other layers need no per-sample quantity of these).

    Returns:
        ``(name, module, rule)`` triples in ``named_modules`` order.

    Raises:
        ValueError: For a BatchNorm layer in train mode (unless skipped), an uncovered
            layer with ``unsupported="error"``, or an unknown ``unsupported``.

    """
    fallback = choice(
        Unsupported,
        unsupported,
        f"capture({arg}",
        allowed=(Unsupported.FUNCTORCH, Unsupported.ERROR),
    )
    targets: List[Tuple[str, nn.Module, LayerRule]] = []
    covered: List[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in covered):
            continue
        if uses_batch_statistics(module):
            if skip_batch_statistics:
                continue
            raise batchnorm_train_error(name, module)
        refuse_reparametrized(name, module)
        refuse_sequence_first(name, module)
        rule = registered_rule(module)
        if rule is None:
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            if fallback == Unsupported.ERROR:
                raise ValueError(
                    f"Module '{name}' ({type(module).__name__}) has trainable parameters "
                    "but no layer rule. Register one with @curvature.layers.register, use "
                    "unsupported='functorch' (exact, replays the module per sample), or "
                    "freeze its parameters."
                )
            rule = _FUNCTIONAL
        if rule.param_names(module):
            targets.append((name, module, rule))
            if rule.covers_children:
                covered.append(name)
    return targets


def refuse_reparametrized(name: str, module: nn.Module) -> None:
    """A ``ValueError`` for a layer whose weight is computed from other tensors.

    ``torch.nn.utils.parametrize`` (e.g. weight norm, orthogonal) and
    ``torch.nn.utils.prune`` replace a parameter by a function of others (``original``,
    ``weight_orig * weight_mask``): the layer rules' per-sample and Kronecker maths are
    for the weight itself, so such a layer is refused by name, with the way out.
    """
    pruned = [
        n[: -len("_orig")]
        for n, _ in module.named_parameters(recurse=False)
        if n.endswith("_orig") and hasattr(module, n[: -len("_orig")] + "_mask")
    ]
    reparametrized = parametrize.is_parametrized(module) or pruned
    if reparametrized and any(p.requires_grad for p in module.parameters()):
        how = (
            "pruned (torch.nn.utils.prune)"
            if pruned
            else "parametrized (torch.nn.utils.parametrize)"
        )
        raise ValueError(
            f"Layer '{name}' ({type(module).__name__}) has a {how} weight: it is computed "
            "from other tensors, which per-sample gradients and KFAC do not cover. Make it "
            "a plain parameter first (torch.nn.utils.prune.remove(module, 'weight') or "
            "torch.nn.utils.parametrize.remove_parametrizations(module, 'weight')), or "
            "freeze the layer."
        )


def refuse_sequence_first(name: str, module: nn.Module) -> None:
    """A ``ValueError`` for ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``
    with ``batch_first=False`` (PyTorch's default) and trainable parameters.

    Its ``linear1``, ``linear2`` and norm layers then see ``[T, N, d]``, the batch on axis
    1, while their rules read axis 0 as the batch: per-sample quantities, EKFAC's
    corrections and the LayerNorm blocks would square and normalize over the wrong axis
    without any error (a hostile-use audit: a Fisher diagonal 10-70% off, LayerNorm
    factors 16-99% off against the ``batch_first=True`` twin).
    """
    kinds = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    attn = getattr(module, "self_attn", None)
    if not isinstance(module, kinds) or not isinstance(attn, nn.MultiheadAttention):
        return
    if attn.batch_first or not any(p.requires_grad for p in module.parameters()):
        return
    raise ValueError(
        f"Layer '{name}' ({type(module).__name__}) runs sequence first (batch_first=False, "
        "PyTorch's default): its linear and norm layers see [T, N, d] inputs, the batch on "
        "axis 1, while their rules take axis 0 as the batch, so per-sample quantities, "
        "EKFAC and the LayerNorm blocks would be silently wrong. Build it with "
        "batch_first=True (the same function and parameters) and pass [N, T, d] inputs, or "
        "freeze it."
    )
