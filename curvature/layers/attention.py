"""``nn.MultiheadAttention``: all projection weights, including ``out_proj``.

``nn.MultiheadAttention`` calls ``F.multi_head_attention_forward`` with
``out_proj.weight`` as a plain tensor, so hooks on ``out_proj`` never fire, and the
projected queries, keys and values never leave the function. The rule therefore covers
the whole module and treats its four projections as Linear sub-layers (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``) with the shared maths of
:class:`~curvature.layers.base.LinearFamilyRule`: per-sample gradients, norms without
materialization, Gram matrices and Kronecker factors. Their inputs ``a`` and output
gradients ``g`` come from, in order of preference:

1. the recorded graph: at record time the rule walks the autograd graph of the output to
   the projection matmuls (the nodes whose weight operand is ``in_proj_weight`` (or a
   chunk of it), ``q/k/v_proj_weight`` or ``out_proj.weight``), keeps their saved inputs
   and adds their output edges to the pull, so the one backward of the capture delivers
   every projection's ``g``; no replay, and dropout masks are the recorded ones (the
   search is :mod:`curvature.layers.attention_graph`);
2. a batched replay of the module from its recorded inputs, with PyTorch's own attention
   code and identity projections (``bias_k``/``bias_v`` or an unexpected graph), checked
   against the recorded output;
3. the exact ``torch.func`` replay per sample, if the replay does not match.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_graph import SUBLAYERS, find_projections, follow_routes, projection_edges
from .base import expanded_gram, expanded_sq_norms
from .functional import FunctionalRule
from .registry import register

_ARG_NAMES = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)
_GRAPH_KEYS = (  # the parameters the recorded projection matmuls give gradients of
    "in_proj_weight",
    "in_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "out_proj.weight",
    "out_proj.bias",
)


def _packed(module: nn.MultiheadAttention) -> bool:
    """Whether q, k, v share one packed ``in_proj_weight [3E, E]`` (``kdim = vdim = E``).

    Otherwise the module has ``q_proj_weight [E, E]``, ``k_proj_weight [E, kdim]`` and
    ``v_proj_weight [E, vdim]`` and registers ``in_proj_weight`` as ``None``.
    """
    return module.in_proj_weight is not None


def _projection_params(module: nn.MultiheadAttention) -> Dict[str, Tuple[Tensor, Optional[Tensor]]]:
    """``{sub-layer: (weight, bias)}`` as used by ``F.multi_head_attention_forward``."""
    E = module.embed_dim
    if _packed(module):
        Wq, Wk, Wv = module.in_proj_weight.chunk(3)
    else:
        Wq, Wk, Wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    b = module.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E : 2 * E], b[2 * E :])
    return {
        "q_proj": (Wq, bq),
        "k_proj": (Wk, bk),
        "v_proj": (Wv, bv),
        "out_proj": (module.out_proj.weight, module.out_proj.bias),
    }


@register(nn.MultiheadAttention)
class MultiheadAttentionRule(FunctionalRule):
    """Per-sample gradients and Kronecker factors of ``nn.MultiheadAttention``."""

    covers_children = True
    needs_outputs = True
    base_edge_outputs = (0,)  # the out-projection result behind the output view

    def __init__(self) -> None:
        super().__init__()
        # per module: where the projection matmuls sat in the graph of its last call
        self._routes: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()

    # -- torch.func fallback configuration ---------------------------------------------
    def batch_axis(self, module):  # noqa: D102
        return 0 if module.batch_first else 1

    def out_batch_axes(self, module, call):  # noqa: D102
        # the attention output follows batch_first; the attention weights are [N, L, S]
        return tuple(self.batch_axis(module) if i == 0 else 0 for i in call.out_index)

    def arg_batch_axes(self, module, call, N):  # noqa: D102
        self._check_dropout(module)
        named = dict(zip(_ARG_NAMES, call.args))
        named.update(call.kwargs)
        mask = named.get("attn_mask")
        if isinstance(mask, Tensor) and mask.dim() == 3:
            raise ValueError(
                "nn.MultiheadAttention with a per-sample 3-D attn_mask [N * num_heads, L, S] "
                "is not supported for per-sample quantities; pass a shared [L, S] mask and "
                "a key_padding_mask [N, S] instead."
            )
        ax = self.batch_axis(module)
        args = tuple(ax if i < 3 else None for i in range(len(call.args)))
        if len(call.args) > 3 and isinstance(call.args[3], Tensor):
            args = args[:3] + (0,) + args[4:]
        kwargs = {k: None for k in call.kwargs}
        if isinstance(call.kwargs.get("key_padding_mask"), Tensor):
            kwargs["key_padding_mask"] = 0
        return args, kwargs

    @staticmethod
    def _check_dropout(module):
        if module.training and module.dropout > 0:
            raise RuntimeError(
                f"nn.MultiheadAttention(dropout={module.dropout}) in train mode draws "
                "random attention masks that cannot be replayed. Use dropout=0.0 or eval "
                "mode while computing per-sample quantities or curvature."
            )

    # -- the projections from the recorded graph (no replay) -----------------------------
    def extra_edges(self, module, args, kwargs, leaves, index):  # noqa: D102
        """Edges of the projection matmuls, found in the graph of the recorded output.

        Returns ``(edges, info)``: one edge per in-projection matmul and one for the
        out-projection, with ``info`` holding their saved inputs and weight rows, so that
        one pull gives every projection's output gradient and no replay is needed.
        """
        if module.bias_k is not None or 0 not in index or not isinstance(leaves[0], Tensor):
            return None
        named = dict(zip(_ARG_NAMES, args))
        named.update(kwargs)
        qkv = [named.get(k) for k in ("query", "key", "value")]
        inputs = [t for t in qkv if isinstance(t, Tensor)]
        routes = self._routes.get(module)
        found = None if routes is None else follow_routes(module, leaves[0], inputs, routes)
        res = None if found is None else projection_edges(module, found)
        if res is None:  # no route yet, or it leads elsewhere or to only some projections
            found = find_projections(module, leaves[0], inputs)
            if found is None:
                return None
            self._routes[module] = found.routes
            res = projection_edges(module, found)
        return res

    def _from_graph(self, module, call) -> Optional[Dict[str, Tuple[Tensor, Tensor]]]:
        """``{sub-layer: (a [N, L, D_in], g [..., N, L, D_out])}`` from the pulled extras."""
        info = getattr(call, "extra_info", None)
        if info is None or call.grads is None:
            return None
        q = dict(zip(_ARG_NAMES, call.args)).get("query", call.kwargs.get("query"))
        if q is None or q.dim() != 3:
            return None
        N = q.shape[0] if module.batch_first else q.shape[1]
        extras = call.grads[len(call.out_index) :]
        res = {}
        for (a, subs), g in zip(info, extras):
            T = a.shape[0] // N  # target (queries, output) or source (keys, values) length
            a = a.reshape(T, N, a.shape[-1]).transpose(0, 1)
            g = g.reshape(*g.shape[:-2], T, N, g.shape[-1]).transpose(-3, -2)
            for name, c0, c1 in subs:
                res[name] = (a, g[..., c0:c1])
        return res

    # -- the batched replay --------------------------------------------------------------
    def _replay(self, module: nn.MultiheadAttention, call) -> Optional[dict]:
        """Sub-layer inputs and output gradients of one call, or ``None`` on mismatch.

        Returns ``{"q_proj": (a [N, S, D_in], g [..., N, S, D_out]), ..., "bias_k": g_rows
        [..., N, E] or absent}`` with the batch first.
        """
        self._check_dropout(module)
        named = dict(zip(_ARG_NAMES, call.args))
        named.update(call.kwargs)
        query, key, value = named["query"], named["key"], named["value"]
        if query.dim() != 3:
            return None  # unbatched input: no per-sample structure
        if module.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        L, N, E = query.shape
        kpm, am = named.get("key_padding_mask"), named.get("attn_mask")
        params = _projection_params(module)
        with torch.no_grad():
            proj = {
                s: F.linear(x, params[s][0], params[s][1]).requires_grad_(True)
                for s, x in zip(("q_proj", "k_proj", "v_proj"), (query, key, value))
            }
        leaves = [proj["q_proj"], proj["k_proj"], proj["v_proj"]]
        k_full, v_full = proj["k_proj"], proj["v_proj"]
        extra: List[str] = []
        if module.bias_k is not None:
            rows_k = module.bias_k.detach().expand(1, N, E).clone().requires_grad_(True)
            rows_v = module.bias_v.detach().expand(1, N, E).clone().requires_grad_(True)
            with torch.enable_grad():
                k_full = torch.cat([k_full, rows_k])
                v_full = torch.cat([v_full, rows_v])
            am = None if am is None else F.pad(am, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
            leaves += [rows_k, rows_v]
            extra = ["bias_k", "bias_v"]
        eye = torch.eye(E, dtype=query.dtype, device=query.device)
        need_weights = bool(named.get("need_weights", True))
        with torch.enable_grad():
            c, weights = F.multi_head_attention_forward(
                proj["q_proj"],
                k_full,
                v_full,
                E,
                module.num_heads,
                None,
                None,
                None,
                None,
                module.add_zero_attn,
                0.0,
                eye,
                None,
                training=False,
                key_padding_mask=kpm,
                need_weights=need_weights,
                attn_mask=am,
                use_separate_proj_weight=True,
                q_proj_weight=eye,
                k_proj_weight=eye,
                v_proj_weight=eye,
                average_attn_weights=bool(named.get("average_attn_weights", True)),
                is_causal=bool(named.get("is_causal", False)),
            )
            Wo, bo = params["out_proj"]
            out = F.linear(c, Wo.detach(), None if bo is None else bo.detach())
            outs = [out if not module.batch_first else out.transpose(0, 1), weights]
        recorded = call.outputs or []
        replayed = [outs[i] for i in call.out_index]
        for r, t, v in zip(replayed, recorded, call.output_versions or []):
            if r is None:
                return None
            if t._version != v:  # modified in place after the layer: nothing to compare
                continue
            tol = 1e-4 if r.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
            if not torch.allclose(r.detach(), t.detach(), rtol=tol, atol=tol):
                return None
        grads = call.grads[: len(call.out_index)]  # the outputs' gradients, not the extras
        batched = grads[0].dim() > recorded[0].dim()
        targets = [c, *leaves]
        with torch.enable_grad():
            g_all = torch.autograd.grad(
                replayed,
                targets,
                grads,
                allow_unused=True,
                is_grads_batched=batched,
            )
        g_c, g_q, g_k, g_v = g_all[:4]
        g_out = grads[call.out_index.index(0)] if 0 in call.out_index else None
        lead = grads[0].shape[:1] if batched else ()

        def zeros_like_out(x):
            return torch.zeros(*lead, *x.shape, dtype=x.dtype, device=x.device)

        if g_out is None:
            g_out = zeros_like_out(out)
        elif module.batch_first:
            g_out = g_out.transpose(-3, -2)
        gs = {
            "q_proj": g_q if g_q is not None else zeros_like_out(proj["q_proj"]),
            "k_proj": g_k if g_k is not None else zeros_like_out(proj["k_proj"]),
            "v_proj": g_v if g_v is not None else zeros_like_out(proj["v_proj"]),
            "out_proj": g_out,
        }
        ins = {"q_proj": query, "k_proj": key, "v_proj": value, "out_proj": c.detach()}
        res: dict = {}
        for s in SUBLAYERS:  # to batch-first [N, L, D]
            res[s] = (ins[s].detach().transpose(0, 1), gs[s].transpose(-3, -2))
        for name, g in zip(extra, g_all[4:]):
            res[name] = g[..., 0, :, :] if g is not None else None
        return res

    def _sublayers(self, module, calls) -> Optional[Dict[str, Tuple[Tensor, Tensor]]]:
        """Expanded ``(a [N, S, 1, D], g [..., N, S, 1, D_out])`` per sub-layer, calls joined."""
        per_call = []
        for call in calls:
            r = self._from_graph(module, call)
            if r is None:
                r = self._replay(module, call)
            if r is None:
                if not getattr(self, "_warned", False):
                    warnings.warn(
                        "nn.MultiheadAttention replay did not reproduce the recorded output; "
                        "falling back to the slower torch.func replay per sample.",
                        stacklevel=3,
                    )
                    self._warned = True
                return None
            per_call.append(r)
        params = _projection_params(module)
        out: Dict[str, Tuple[Tensor, Tensor]] = {}
        for s in SUBLAYERS:
            W, b = params[s]
            has_w, has_b = W.requires_grad, b is not None and b.requires_grad
            if not (has_w or has_b):
                continue
            a_list, g_list = [], []
            for r in per_call:
                a, g = r[s]
                a = a.unsqueeze(-2)
                parts = ([a] if has_w else []) + ([a.new_ones(*a.shape[:-1], 1)] if has_b else [])
                a_list.append(torch.cat(parts, -1) if len(parts) > 1 else parts[0])
                g_list.append(g.unsqueeze(-2))
            out[s] = (torch.cat(a_list, 1), torch.cat(g_list, -3))
        for s in ("bias_k", "bias_v"):
            p = getattr(module, s)
            if p is not None and p.requires_grad:
                out[s] = sum(r[s] for r in per_call)  # [..., N, E]
        return out

    # -- per-sample quantities --------------------------------------------------------------
    def _targets(self, module) -> Dict[str, Tuple[Optional[str], Optional[str], int, int]]:
        """Per sub-layer: ``(weight key, bias key, first weight row, first bias row)``.

        Keys name entries of the result dictionary, ``None`` when that parameter is not
        trainable; the rows of the packed ``in_proj_weight`` / ``in_proj_bias`` are
        ``[q; k; v]``.
        """
        E = module.embed_dim
        params = _projection_params(module)
        res = {}
        for i, s in enumerate(SUBLAYERS):
            W, b = params[s]
            if s == "out_proj":
                wk, bk, row = "out_proj.weight", "out_proj.bias", 0
            elif _packed(module):
                wk, bk, row = "in_proj_weight", "in_proj_bias", i * E
            else:
                wk, bk, row = f"{s}_weight", "in_proj_bias", 0
            bias_row = 0 if s == "out_proj" else i * E
            res[s] = (
                wk if W.requires_grad else None,
                bk if b is not None and b.requires_grad else None,
                row,
                bias_row,
            )
        return res

    def _grads_from_graph(self, module, calls, out) -> Optional[Dict[str, Tensor]]:
        """Per-sample gradients written straight into the results, from the pulled extras.

        For each projection matmul of the recorded graph, ``sum_t g[n, t] a[n, t]^T`` is
        one batched matrix product into the rows of the result it owns (one product for
        the packed q/k/v projection), and the bias is ``sum_t g[n, t]``. ``None`` if a
        call has no graph information (the caller then replays).
        """
        infos = []
        for call in calls:
            if self._from_graph(module, call) is None:
                return None
            info = call.extra_info
            q = dict(zip(_ARG_NAMES, call.args)).get("query", call.kwargs.get("query"))
            if q is None or q.dim() != 3:
                return None
            infos.append((info, call.grads[len(call.out_index) :], q))
        targets = self._targets(module)
        params = dict(module.named_parameters())
        N = infos[0][2].shape[0] if module.batch_first else infos[0][2].shape[1]
        names = self.param_names(module)
        res: Dict[str, Tensor] = {}
        accumulate = len(calls) > 1
        for key in names:
            if key not in _GRAPH_KEYS:
                return None  # e.g. bias_k / bias_v: only the replay gives those
            p = params[key]
            dtype = infos[0][1][0].dtype
            if out is not None and key in out and out[key].dtype == dtype:
                res[key] = out[key]
            else:
                res[key] = torch.empty((N, *p.shape), dtype=dtype, device=p.device)
            if accumulate:
                res[key].zero_()
        for info, extras, _ in infos:
            for (a, subs), g in zip(info, extras):
                T = a.shape[0] // N
                a = a.reshape(T, N, a.shape[-1]).transpose(0, 1)  # [N, T, D_in]
                g_tn = g.reshape(T, N, g.shape[-1])  # rows in (T, N) order, as computed
                g = g_tn.transpose(0, 1)  # [N, T, width]
                # group consecutive sub-layers that fill consecutive rows of one result
                groups: List[list] = []
                for name, c0, c1 in subs:
                    wk, bk, row, brow = targets[name]
                    last = groups[-1] if groups else None
                    if (
                        last is not None
                        and last[0] == wk
                        and last[1] == bk
                        and last[4] == c0
                        and last[2] + (last[4] - last[3]) == row
                        and last[5] + (last[4] - last[3]) == brow
                    ):
                        last[4] = c1
                    else:
                        groups.append([wk, bk, row, c0, c1, brow])
                for wk, bk, row, c0, c1, brow in groups:
                    gs = g[..., c0:c1]
                    width = c1 - c0
                    if wk is not None:
                        target = res[wk][:, row : row + width]
                        if accumulate:
                            target.baddbmm_(gs.transpose(1, 2), a.to(gs.dtype))
                        elif target.is_contiguous():
                            torch.bmm(gs.transpose(1, 2), a.to(gs.dtype), out=target)
                        else:
                            target.copy_(torch.bmm(gs.transpose(1, 2), a.to(gs.dtype)))
                    if bk is not None:  # sum over T of the (T, N) layout: a fast reduction
                        target = res[bk][:, brow : brow + width]
                        if accumulate:
                            target.add_(g_tn[..., c0:c1].sum(0))
                        elif target.is_contiguous():
                            torch.sum(g_tn[..., c0:c1], 0, out=target)
                        else:
                            target.copy_(g_tn[..., c0:c1].sum(0))
        for key, t in res.items():
            if out is not None and key in out and t is not out[key]:
                res[key] = out[key].copy_(t)
        return {k: res[k] for k in names}

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        fast = self._grads_from_graph(module, calls, out)
        if fast is not None:
            return fast
        subs = self._sublayers(module, calls)
        if subs is None:
            return super().per_sample_grads(module, calls, out)
        params = _projection_params(module)
        grads: Dict[str, Dict[str, Tensor]] = {}
        for s, val in subs.items():
            if s in ("bias_k", "bias_v"):
                continue
            a, g = val
            W, b = params[s]
            full = torch.einsum("nsco,nsci->noi", g, a)  # [N, D_out, D]
            parts = {}
            if W.requires_grad:
                parts["weight"] = full[..., : W.shape[1]]
            if b is not None and b.requires_grad:
                parts["bias"] = full[..., -1]
            grads[s] = parts
        res: Dict[str, Tensor] = {}
        if _packed(module):
            if module.in_proj_weight.requires_grad:
                res["in_proj_weight"] = torch.cat([grads[s]["weight"] for s in SUBLAYERS[:3]], 1)
        else:
            for s in SUBLAYERS[:3]:
                if "weight" in grads.get(s, {}):
                    res[f"{s}_weight"] = grads[s]["weight"]
        if module.in_proj_bias is not None and module.in_proj_bias.requires_grad:
            res["in_proj_bias"] = torch.cat([grads[s]["bias"] for s in SUBLAYERS[:3]], 1)
        for s in ("bias_k", "bias_v"):
            if s in subs:
                res[s] = subs[s].unsqueeze(1)  # [N, 1, 1, E] like the parameter [1, 1, E]
                res[s] = res[s].reshape(res[s].shape[0], *getattr(module, s).shape)
        for k, v in grads.get("out_proj", {}).items():
            res[f"out_proj.{k}"] = v
        names = self.param_names(module)
        return {k: res[k].contiguous() for k in names if k in res}

    def per_sample_sq_norms(self, module, calls):  # noqa: D102
        subs = self._sublayers(module, calls)
        if subs is None:
            return super().per_sample_sq_norms(module, calls)
        total = 0
        for s, val in subs.items():
            if s in ("bias_k", "bias_v"):
                total = total + val.pow(2).sum(-1)
            else:
                total = total + expanded_sq_norms(*val)
        return total

    def gram(self, module, calls):  # noqa: D102
        subs = self._sublayers(module, calls)
        if subs is None:
            return super().gram(module, calls)
        total = 0
        for s, val in subs.items():
            total = total + (val @ val.T if s in ("bias_k", "bias_v") else expanded_gram(*val))
        return total

    # -- Kronecker factors -------------------------------------------------------------------
    def expanded_blocks(self, module, calls):  # noqa: D102
        if module.bias_k is not None and module.bias_k.requires_grad:
            return None
        if any(c.grads is None for c in calls):
            return None  # forward-only: the replay needs output gradients
        return self._sublayers(module, calls)

    def kfac_index(self, module, offsets, device=None):  # noqa: D102
        if module.bias_k is not None and module.bias_k.requires_grad:
            return None
        E = module.embed_dim
        params = _projection_params(module)
        index: Dict[str, Tensor] = {}
        for i, s in enumerate(SUBLAYERS):
            W, b = params[s]
            cols = []
            if W.requires_grad:
                D_in = W.shape[1]
                if s == "out_proj":
                    base = offsets["out_proj.weight"]
                elif _packed(module):
                    base = offsets["in_proj_weight"] + i * E * D_in
                else:
                    base = offsets[f"{s}_weight"]
                cols.append(torch.arange(base, base + E * D_in, device=device).view(E, D_in))
            if b is not None and b.requires_grad:
                base = (
                    offsets["out_proj.bias"] if s == "out_proj" else offsets["in_proj_bias"] + i * E
                )
                cols.append(torch.arange(base, base + E, device=device).view(E, 1))
            if cols:
                index[s] = torch.cat(cols, 1).unsqueeze(0)
        return index

    def kfac_shapes(self, module):  # noqa: D102
        if type(self).kfac_index is not MultiheadAttentionRule.kfac_index:  # a subclass's own
            return super().kfac_shapes(module)
        if module.bias_k is not None and module.bias_k.requires_grad:
            return None
        out = {}
        for s, (W, b) in _projection_params(module).items():
            D = (W.shape[1] if W.requires_grad else 0) + (b is not None and b.requires_grad)
            if D:
                out[s] = (1, module.embed_dim, D)
        return out
