"""The ``torch.func`` fallback for parameterized layers without a dedicated rule.

For a module ``f(theta, x)`` and the output gradients ``g_n`` received from the
captured backward, the per-sample gradient is the vector-Jacobian product
``grad_n = (d f(theta, x_n) / d theta)^T g_n``, computed for all samples at once with
``vmap(vjp)``. This re-runs the *module's own* forward per sample (never the model's),
so it is exact for any per-sample module, at the cost of one extra module forward.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten

from .base import Call, LayerRule, replaying


class ReplayRandomnessError(RuntimeError):
    """A module cannot be replayed per sample: it draws random numbers (dropout in train
    mode), or its forward fails under ``vmap`` (e.g. a recurrent layer fed a learned state
    by a container that is replayed whole for its own parameters).
    """


class FunctionalRule(LayerRule):
    """Per-sample gradients of a module's direct parameters via ``vmap(vjp)``.

    Tensor inputs whose batch axis (axis 0, see :meth:`batch_axis`) has the batch size
    are treated as per-sample; other inputs are shared by all samples.

    Warning:
        Random modules (dropout in train mode) cannot be replayed: ``vmap`` raises, and
        so do we, with a hint to use eval mode for that module.

    """

    #: Largest number of samples replayed at once (bounds memory); ``None`` = all.
    chunk_size: Optional[int] = None

    def batch_axis(self, module: nn.Module) -> int:
        """The batch axis of the module's tensor inputs and outputs."""
        return 0

    def out_batch_axes(self, module: nn.Module, call: Call) -> Tuple[int, ...]:
        """The batch axis of each recorded output (``batch_axis`` by default)."""
        return tuple(self.batch_axis(module) for _ in call.out_index)

    def batch_size(self, module, call):  # noqa: D102
        return call.args[0].shape[self.batch_axis(module)]

    def arg_batch_axes(self, module: nn.Module, call: Call, N: int) -> Tuple[Any, Any]:
        """``in_dims`` for ``(args, kwargs)``: the batch axis or ``None`` (shared)."""
        ax = self.batch_axis(module)

        def dim(x: Any) -> Optional[int]:
            if isinstance(x, Tensor) and x.dim() > ax and x.shape[ax] == N:
                return ax
            return None

        args = tuple(dim(x) for x in call.args)
        kwargs = {k: dim(v) for k, v in call.kwargs.items()}
        return args, kwargs

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        names = self.param_names(module)
        params = {n: p.detach() for n, p in module.named_parameters() if n in names}
        total: Dict[str, Tensor] = {}
        for call in calls:
            N = self.batch_size(module, call)
            arg_dims, kw_dims = self.arg_batch_axes(module, call, N)
            out_dims = self.out_batch_axes(module, call)
            grads = list(call.grads[: len(call.out_index)])  # outputs only, no extras

            def sample_grad(
                p,
                args,
                kwargs,
                gs,
                arg_dims=arg_dims,
                kw_dims=kw_dims,
                call=call,
                out_dims=out_dims,
            ):
                # re-insert a batch axis of size one so the module sees its usual layout
                args = tuple(a.unsqueeze(d) if d is not None else a for a, d in zip(args, arg_dims))
                kwargs = {
                    k: (v.unsqueeze(kw_dims[k]) if kw_dims[k] is not None else v)
                    for k, v in kwargs.items()
                }

                def f(p):
                    out = functional_call(module, p, args, kwargs)
                    leaves, _ = tree_flatten(out)
                    return tuple(leaves[i].squeeze(d) for i, d in zip(call.out_index, out_dims))

                _, pullback = vjp(f, p)
                return pullback(tuple(gs))[0]

            try:
                with warnings.catch_warnings(), replaying():
                    # vmap's "performance drop ... batching rule" notes are not actionable
                    warnings.filterwarnings("ignore", message="There is a performance drop")
                    per_sample = vmap(
                        sample_grad,
                        in_dims=(None, arg_dims, kw_dims, out_dims),
                        chunk_size=self.chunk_size,
                    )(params, call.args, call.kwargs, tuple(grads))
            except RuntimeError as err:
                own = [n for n, q in module.named_parameters(recurse=False) if q.requires_grad]
                why = (  # a container's own parameter: the whole container is replayed
                    f" Its own parameters {own} (directly on it, beside its submodules) "
                    "have no layer rule, so the whole module is replayed per sample for "
                    "them: move them into a submodule of their own or freeze them."
                    if own and any(True for _ in module.children())
                    else ""
                )
                name = type(module).__name__
                if "random" in str(err).lower():
                    raise ReplayRandomnessError(
                        f"{name} draws random numbers in its forward (dropout in train "
                        "mode?), so its per-sample gradients cannot be replayed. Put this "
                        "module in eval mode, or give it a layer rule." + why
                    ) from err
                if why:  # (a learned initial state fed to a recurrent layer, say)
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    raise ReplayRandomnessError(
                        f"{name}'s forward fails when replayed per sample under "
                        f"torch.func.vmap ({first}), so the per-sample gradients of its "
                        "own parameters cannot be computed." + why
                    ) from err
                raise
            for k, v in per_sample.items():
                total[k] = total[k] + v if k in total else v
        return total
