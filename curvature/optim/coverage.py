"""What the optimizers say about parameters that get no curvature.

BatchNorm layers that normalize with batch statistics (train mode) are left out of the
statistics: the output of one sample depends on the whole batch, so per-sample quantities
of their parameters (a per-sample Fisher diagonal, an exact block) are undefined. Their
parameters get the plain gradient through the usual ``lr`` / ``momentum`` /
``weight_decay`` path. The other layers keep their curvature: their statistics need only
their own inputs and output gradients, which are defined with BatchNorm in train mode
too; as in kfac-pytorch, the rows of the batch's output gradient stand in for per-sample
gradients.
"""

from __future__ import annotations

from typing import List

from ..layout import tie_hint
from ..options import Unsupported
from ..warn import warn


def owner(param_name: str) -> str:
    """The name of the module that owns the parameter ``param_name``."""
    return param_name.rpartition(".")[0]


def report_batch_statistics(who: str, names: List[str], unsupported: Unsupported) -> bool:
    """Warn about (or refuse) the parameters ``names`` of BatchNorm layers in train mode.

    Args:
        who: The optimizer's name.
        names: Parameter names (of BatchNorm layers left out of the statistics).
        unsupported: The optimizer's policy; only ``"error"`` changes anything here (a
            per-sample diagonal is undefined for these parameters).

    Returns:
        Whether ``names`` was not empty (one warning was given).

    Raises:
        ValueError: With ``unsupported="error"``, naming the layers and the ways out.

    """
    if not names:
        return False
    layers = sorted({owner(n) for n in names})
    shown = ", ".join(repr(n) for n in layers[:4]) + (
        f" and {len(layers) - 4} more" if len(layers) > 4 else ""
    )
    msg = (
        f"{who}: {len(layers)} BatchNorm layer(s) ({shown}) normalize with batch statistics "
        "(train mode), which mix the samples: per-sample quantities of their parameters are "
        "undefined, so they get no curvature"
    )
    if unsupported == Unsupported.ERROR:
        raise ValueError(
            msg + ". Pass unsupported='warn' to update them with the plain gradient, put them "
            "in eval mode before building the optimizer (running statistics), or replace "
            "them by nn.GroupNorm."
        )
    warn(
        msg + " and are updated with the plain gradient (lr, momentum, weight_decay); every "
        "other layer gets its curvature as usual."
    )
    return True


def report_uncovered(who: str, listed: List[str], unsupported: Unsupported, tied: bool) -> None:
    """Warn about (or refuse) parameters that no curvature rule covers.

    Args:
        who: The optimizer's name.
        listed: One entry per parameter: its name, with the reason where one is known.
        unsupported: The optimizer's policy (``"diagonal"`` changes the message,
            ``"error"`` raises).
        tied: Whether some of them are tied weights (adds how to precondition them).

    Raises:
        ValueError: With ``unsupported="error"``.

    """
    diagonal = unsupported == Unsupported.DIAGONAL
    grouped: dict = {}  # the parameters of one reason (a layer's) named together
    for entry in listed:
        head, sep, why = entry.partition(" (")
        grouped.setdefault(sep + why if sep else id(entry), []).append(head if sep else entry)
    listed = [", ".join(names) + (k if isinstance(k, str) else "") for k, names in grouped.items()]
    msg = f"{who}: no curvature rule covers [{', '.join(listed)}]; " + (
        "they are preconditioned by their per-sample Fisher diagonal."
        if diagonal
        else "they are updated with the plain gradient."
    )
    if tied:
        msg += " " + tie_hint("use DiagonalNaturalGradient, or unsupported='diagonal'")
    elif not diagonal and "more than an exact block takes" in msg:
        msg += " unsupported='diagonal' preconditions them by their per-sample Fisher diagonal."
    if unsupported == Unsupported.ERROR:
        raise ValueError(msg.replace("they are updated", "pass unsupported='warn' to update them"))
    warn(msg)


def no_statistics_message(who: str, names: List[str]) -> str:
    """The one warning of an optimizer with blocks that have had no statistics yet."""
    return (
        f"{who}: no curvature statistics yet for {names} (not reached by the curvature "
        "backward, a model in eval mode, a layer under torch.utils.checkpoint with "
        "use_reentrant=True (use use_reentrant=False), or only non-finite batches); they "
        "get the plain gradient."
    )


def late_backward_message(who: str) -> str:
    """The one warning of a second backward through an already folded forward (empirical)."""
    return (
        f"{who}(fisher='empirical'): a second backward pass ran through a forward whose "
        "gradients were already used; the curvature uses each forward's first backward "
        "only. Sum the losses and call backward() once."
    )


def graph_backward_message(who: str) -> str:
    """The one warning of a ``create_graph=True`` backward through the model (empirical)."""
    return (
        f"{who}(fisher='empirical'): a backward with create_graph=True (e.g. a gradient "
        "penalty) ran through the model: the statistics then include the gradients at the "
        "layer outputs of everything your backward() differentiates, not of loss_func "
        "alone. Use fisher='mc' or 'type-2' for the curvature of loss_func."
    )


def no_root_message(who: str, fisher: str, model: object) -> str:
    """The one warning when layers ran but the optimizer's model never did (pulls)."""
    return (
        f"{who}(fisher={fisher!r}): the layers ran but the model the optimizer was built "
        f"on ({type(model).__name__}) was never called, so no curvature backward ran. "
        "Build the optimizer on the module you call (e.g. KFAC(self.net) when "
        "training_step calls self.net(x)), or call that model."
    )


def replaced_message(who: str, names: List[str]) -> str:
    """The error for model parameters that are no longer the tensors the optimizer holds."""
    return (
        f"{who}: the model's parameters {names} are not the tensors the optimizer was built "
        "with (replaced, e.g. by load_state_dict(..., assign=True) or by assigning a new "
        "nn.Parameter or module): the optimizer would update the old tensors and these "
        "would never train. Build the optimizer after replacing them, or load weights "
        "with load_state_dict() without assign=True (it copies into the parameters)."
    )


def warn_joined_outputs(who: str, loss_input: object, output: object) -> bool:
    """Warn (once: returns ``True``) when ``loss_func`` gets more samples than the forward's
    ``output`` after an earlier forward of the step was pulled from its own output: one
    loss over several forwards' outputs (``torch.cat`` of model calls), which the pulled
    Fisher types weight unequally.
    """
    n = getattr(loss_input, "shape", ())[:1]
    m = getattr(output, "shape", ())[:1]
    if not n or not m or n[0] <= m[0]:
        return False
    warn(
        f"{who}: loss_func received {n[0]} samples where this forward's output has {m[0]}, "
        "after an earlier forward of this step whose loss_func call never came was pulled "
        "from its own output: one loss over the outputs of several forwards (torch.cat of "
        "model calls)? Those forwards are then weighted unequally in the curvature (two "
        "halves: type-2 G at 2/3 of the union's). Call loss_func on each forward's output "
        "and sum the losses."
    )
    return True
