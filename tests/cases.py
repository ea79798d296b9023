"""Per-sample gradient test cases as data, and the brute-force twins they are checked against.

A :class:`Case` is a model factory, an input factory, a target factory and a loss factory.
``conftest.py`` expands :data:`CASES` over :data:`DTYPES`, :data:`REDUCTIONS` and
:data:`BATCH_SIZES` in one place (the ``problem`` fixture); every test that takes
``problem`` runs on the whole grid.

Conventions checked (SPEC sections 1 and 2): ``l_n`` is the loss module applied to sample
``n`` alone (a batch of one, same reduction) and a per-sample gradient is ``grad l_n``,
not scaled by the reduction factor ``R`` (``1/N`` for mean, ``1`` for sum).

Every model takes batch-first inputs; models around ``nn.MultiheadAttention(batch_first=
False)`` transpose internally, so the twins can slice samples off axis 0.
"""

from __future__ import annotations

import copy
import functools
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

Inputs = Union[Tensor, Tuple[Tensor, ...]]

DTYPES = (torch.float64,)
REDUCTIONS = ("mean", "sum")
BATCH_SIZES = (1, 7)

ATOL = 1e-10
RTOL = 1e-8


# ---------------------------------------------------------------------------------------
# The brute-force twins and the comparison helper
# ---------------------------------------------------------------------------------------
def train_step(opt, model, X, y, loss_func=None) -> float:
    """One ``zero_grad``, forward, loss (cross-entropy unless given), backward, ``step``."""
    opt.zero_grad()
    loss = (loss_func or nn.CrossEntropyLoss())(model(X), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def as_tuple(X: Inputs) -> Tuple[Tensor, ...]:
    """Model inputs as a tuple (a single tensor becomes a 1-tuple)."""
    return X if isinstance(X, tuple) else (X,)


def run_model(model: nn.Module, X: Inputs) -> Tensor:
    """``model(*X)`` for tuple inputs, ``model(X)`` otherwise."""
    return model(*as_tuple(X))


def trainable(model: nn.Module) -> Dict[str, Tensor]:
    """Trainable parameters in ``model.named_parameters()`` order."""
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def torch_func_per_sample_grads(
    model: nn.Module, loss_func: nn.Module, X: Inputs, y: Tensor
) -> Dict[str, Tensor]:
    """``vmap(grad(l_n))`` with ``functional_call`` on a batch of one (sample unsqueezed)."""
    # functional_call on a model that uses one module twice leaves plain tensors in place
    # of its parameters afterwards (torch.func), so the twin works on a copy
    model = copy.deepcopy(model)
    params = {k: p.detach() for k, p in trainable(model).items()}

    def sample_loss(p: Dict[str, Tensor], xs: Tuple[Tensor, ...], t: Tensor) -> Tensor:
        out = functional_call(model, p, tuple(x.unsqueeze(0) for x in xs))
        return loss_func(out, t.unsqueeze(0))

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, as_tuple(X), y)


def loop_per_sample_grads(
    model: nn.Module, loss_func: nn.Module, X: Inputs, y: Tensor
) -> Dict[str, Tensor]:
    """An explicit Python loop: ``autograd.grad(loss_func(model(x_n[None]), y_n[None]))``."""
    params = trainable(model)
    rows: List[Tuple[Tensor, ...]] = []
    for n in range(y.shape[0]):
        xs = tuple(x[n : n + 1] for x in as_tuple(X))
        loss = loss_func(model(*xs), y[n : n + 1])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        rows.append(
            tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values()))
        )
    return {k: torch.stack([row[i] for row in rows]) for i, k in enumerate(params)}


def flat(grads: Dict[str, Tensor]) -> Tensor:
    """``[N, P]``: per-sample gradients flattened and concatenated in dict order."""
    return torch.cat([g.flatten(1) for g in grads.values()], dim=1)


def grad_mismatches(
    actual: Dict[str, Tensor],
    expected: Dict[str, Tensor],
    *,
    atol: float = ATOL,
    rtol: float = RTOL,
) -> List[str]:
    """Every difference between two name -> per-sample gradient maps (empty if equal).

    Keys must agree in order, and each tensor in shape, dtype and value.
    """
    problems: List[str] = []
    if list(actual) != list(expected):
        problems.append(f"names {list(actual)} != expected {list(expected)}")
    for name, e in expected.items():
        a = actual.get(name)
        if a is None:
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            problems.append(
                f"{name}: {a.dtype} {tuple(a.shape)} != expected {e.dtype} {tuple(e.shape)}"
            )
        elif not torch.allclose(a, e, atol=atol, rtol=rtol):
            err = (a - e).abs().max().item()
            problems.append(f"{name}: max abs error {err:.3e} (scale {e.abs().max().item():.3e})")
    return problems


def assert_grads_match(actual: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    """Assert that :func:`grad_mismatches` finds nothing."""
    problems = grad_mismatches(actual, expected)
    assert not problems, "per-sample gradients differ:\n  " + "\n  ".join(problems)


def assert_close(actual: Tensor, expected: Tensor) -> None:
    """``torch.testing.assert_close`` with the suite's tolerances."""
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------
# Building a problem from a case
# ---------------------------------------------------------------------------------------
@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set the default floating dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class Case:
    """One model/data/loss combination; factories run under the case's default dtype."""

    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int], Inputs]
    targets: Callable[[int], Tensor]
    loss: Callable[..., nn.Module]


@dataclass
class Problem:
    """A case built for one dtype, reduction and batch size, with its twins (cached)."""

    case: Case
    dtype: torch.dtype
    reduction: str
    N: int
    model: nn.Module
    X: Inputs
    y: Tensor
    loss_func: nn.Module

    @functools.cached_property
    def reference(self) -> Dict[str, Tensor]:
        """The ``torch.func`` twin's per-sample gradients."""
        return torch_func_per_sample_grads(self.model, self.loss_func, self.X, self.y)


def build(case: Case, dtype: torch.dtype, reduction: str, N: int) -> Problem:
    """Build a case deterministically (seeded by its name and batch size)."""
    with default_dtype(dtype):
        torch.manual_seed(zlib.crc32(f"{case.name}/{N}".encode()))
        model = case.model()
        X = case.inputs(N)
        y = case.targets(N)
        loss_func = case.loss(reduction=reduction)
    return Problem(case, dtype, reduction, N, model, X, y, loss_func)


# ---------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------
class Transpose(nn.Module):
    """Swap two axes (e.g. ``[N, S, C] -> [N, C, S]`` for CrossEntropyLoss)."""

    def __init__(self, dim0: int, dim1: int):
        super().__init__()
        self.dims = (dim0, dim1)

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(*self.dims)


class Twice(nn.Module):
    """Apply one module twice (weight sharing across calls), then a head."""

    def __init__(self, shared: nn.Module, head: nn.Module):
        super().__init__()
        self.shared = shared
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.shared(torch.tanh(self.shared(x))))


class GatedLinear(nn.Module):
    """A layer without a rule: its own parameter ``gate`` plus a child ``nn.Linear``."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(d_out))
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * torch.sigmoid(self.gate) + torch.tanh(self.gate) * x.sum(
            -1, keepdim=True
        )


class TwoInputs(nn.Module):
    """``nn.Bilinear`` (fallback rule, two per-sample inputs) followed by a Linear."""

    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(3, 4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bilinear(x1, x2)))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` on batch-first inputs, followed by a Linear head.

    Inputs: ``(x [N, L, E], kv [N, S, kdim or E], mask [N, S])``. Keys are ``kv``, values
    are a fixed function of ``kv`` cut to ``vdim``. Output ``[N, L, 3]`` (``[N, 3, L]``
    with ``logits_first``). With ``batch_first=False`` the model
    transposes to ``[L, N, E]`` around the attention.
    """

    def __init__(
        self,
        *,
        batch_first: bool,
        need_weights: bool = True,
        use_weights: bool = False,
        average_attn_weights: bool = True,
        causal: bool = False,
        embed_dim: int = 6,
        vdim: Optional[int] = None,
        logits_first: bool = False,
        **kwargs,
    ):
        super().__init__()
        self.att = nn.MultiheadAttention(embed_dim, 2, batch_first=batch_first, vdim=vdim, **kwargs)
        self.head = nn.Linear(embed_dim, 3)
        self.batch_first = batch_first
        self.need_weights = need_weights
        self.use_weights = use_weights
        self.average_attn_weights = average_attn_weights
        self.causal = causal
        self.logits_first = logits_first
        self.vdim = vdim or embed_dim

    def forward(self, x: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        q, k, v = x, kv, torch.cos(kv).repeat(1, 1, 2)[..., : self.vdim]
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        attn_mask = None
        if self.causal:
            L = x.shape[1]
            attn_mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        o, w = self.att(
            q,
            k,
            v,
            key_padding_mask=mask,
            need_weights=self.need_weights,
            attn_mask=attn_mask,
            average_attn_weights=self.average_attn_weights,
        )
        if not self.batch_first:
            o = o.transpose(0, 1)
        out = self.head(o)
        if self.use_weights:  # gradients also flow into the weights [N, (H,) L, S]
            extra = w.pow(2).sum(-1)
            out = out + (extra if extra.dim() == 2 else extra.mean(1)).unsqueeze(-1)
        return out.transpose(1, 2) if self.logits_first else out  # [N, 3, L] for CE


class AttentionTwice(nn.Module):
    """One ``nn.MultiheadAttention`` called twice: cross-attention, then self-attention."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(
            6, 2, batch_first=True, add_bias_kv=True, add_zero_attn=True
        )
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        h = self.att(x, kv, kv, key_padding_mask=mask)[0]
        h = self.att(h, h, h, need_weights=False)[0]
        return self.head(h)


def attention_inputs(L: int = 4, S: int = 5, E: int = 6, kdim: Optional[int] = None):
    """Input factory for :class:`Attention`: queries, keys and a key padding mask."""

    def make(N: int) -> Tuple[Tensor, Tensor, Tensor]:
        mask = torch.rand(N, S) < 0.3
        mask[:, 0] = False  # every sample keeps at least one key
        return torch.randn(N, L, E), torch.randn(N, S, kdim or E), mask

    return make


class TinyTransformer(nn.Module):
    """Embedding, LayerNorm, self-attention, RMSNorm, GroupNorm and a Linear head."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        self.rms = nn.RMSNorm(d)
        self.gn = nn.GroupNorm(2, d)
        self.fc = nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.ln(self.emb(idx))
        h = h + self.att(h, h, h, need_weights=False)[0]
        h = self.gn(self.rms(h).transpose(1, 2)).transpose(1, 2)
        return self.fc(h).transpose(1, 2)  # [N, vocab, S]


def frozen(module: nn.Module, *names: str) -> nn.Module:
    """Freeze the named parameters of ``module`` (all of them if none are named)."""
    for name, p in module.named_parameters():
        if not names or name in names:
            p.requires_grad_(False)
    return module


def eval_batchnorm(bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A BatchNorm in eval mode with non-trivial running statistics and affine params."""
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return bn.eval()


def randn(*shape: int) -> Callable[[int], Tensor]:
    """Factory of standard normal tensors ``[N, *shape]``."""
    return lambda N: torch.randn(N, *shape)


def randint(high: int, *shape: int) -> Callable[[int], Tensor]:
    """Factory of integer tensors ``[N, *shape]`` in ``[0, high)`` (labels, tokens)."""
    return lambda N: torch.randint(0, high, (N, *shape))


def binary(*shape: int) -> Callable[[int], Tensor]:
    """Factory of 0/1 targets ``[N, *shape]`` in the default floating dtype."""
    return lambda N: torch.randint(0, 2, (N, *shape)).to(torch.get_default_dtype())


def probabilities(C: int) -> Callable[[int], Tensor]:
    """Factory of class-probability targets ``[N, C]`` (soft labels)."""
    return lambda N: torch.softmax(torch.randn(N, C), dim=1)


def with_pads(high: int, *shape: int, pad: int = 0) -> Callable[[int], Tensor]:
    """Token factory ``[N, *shape]`` where about a third of the tokens are ``pad``."""

    def make(N: int) -> Tensor:
        idx = torch.randint(1, high, (N, *shape))
        return torch.where(torch.rand(N, *shape) < 0.3, torch.full_like(idx, pad), idx)

    return make


CE = nn.CrossEntropyLoss
MSE = nn.MSELoss
BCE = nn.BCEWithLogitsLoss
Seq = nn.Sequential


# ---------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------
CASES: List[Case] = [
    # -- Linear -----------------------------------------------------------------------
    Case(
        "linear_relu_inplace_ce",
        lambda: Seq(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)),
        randn(5),
        randint(3),
        CE,
    ),
    Case(
        "linear_no_bias_mse",
        lambda: Seq(nn.Linear(4, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False)),
        randn(4),
        randn(3),
        MSE,
    ),
    Case(
        "linear_4d_input_bce",  # inputs [N, 4, 8, D]: 32 shared positions
        lambda: Seq(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        randn(4, 8, 3),
        binary(4, 8, 2),
        BCE,
    ),
    Case(
        "linear_short_sequence_wide_mse",  # [N, 2, 12]: few positions, wide layers
        lambda: Seq(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 10)),
        randn(2, 12),
        randn(2, 10),
        MSE,
    ),
    Case(
        "linear_sequence_ce_trailing_axes",  # logits [N, C, S], labels [N, S]
        lambda: Seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), Transpose(1, 2)),
        randn(6, 4),
        randint(3, 6),
        CE,
    ),
    Case(
        "linear_ce_label_smoothing",
        lambda: Seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        randn(4),
        randint(3),
        functools.partial(CE, label_smoothing=0.2),
    ),
    Case(
        "linear_ce_soft_labels",
        lambda: Seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        randn(4),
        probabilities(3),
        CE,
    ),
    Case(
        "linear_bce_pos_weight",
        lambda: Seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        randn(4),
        binary(3),
        lambda reduction: BCE(reduction=reduction, pos_weight=torch.tensor([0.5, 2.0, 3.0])),
    ),
    Case(
        "linear_frozen_weight_and_frozen_bias",
        lambda: Seq(
            frozen(nn.Linear(4, 5), "weight"),  # trainable bias only
            nn.Tanh(),
            frozen(nn.Linear(5, 5), "bias"),  # trainable weight only
            nn.Tanh(),
            nn.Linear(5, 3),
        ),
        randn(3, 4),
        randn(3, 3),
        MSE,
    ),
    Case(
        "linear_fully_frozen_layers_skipped",
        lambda: Seq(frozen(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 3), frozen(nn.LayerNorm(3))),
        randn(4),
        randint(3),
        CE,
    ),
    Case(
        "linear_used_twice",
        lambda: Twice(nn.Linear(4, 4), nn.Linear(4, 2)),
        randn(4),
        randn(2),
        MSE,
    ),
    Case(
        "linear_used_twice_on_sequence",
        lambda: Twice(nn.Linear(4, 4), nn.Linear(4, 2)),
        randn(3, 4),
        randn(3, 2),
        MSE,
    ),
    # -- Convolutions ------------------------------------------------------------------
    Case(
        "conv1d_stride_padding",
        lambda: Seq(
            nn.Conv1d(2, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)
        ),
        randn(2, 8),
        randint(3),
        CE,
    ),
    Case(
        "conv1d_same_even_kernel_reflect",
        lambda: Seq(
            nn.Conv1d(2, 3, 4, padding="same", padding_mode="reflect"),
            nn.Tanh(),
            nn.Conv1d(3, 3, 3, padding=2, padding_mode="replicate", bias=False),
            nn.Flatten(),
            nn.Linear(30, 2),
        ),
        randn(2, 8),
        randn(2),
        MSE,
    ),
    Case(
        "conv1d_ce_trailing_axes",  # logits [N, C, L], labels [N, L]
        lambda: Seq(nn.Conv1d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 3, 1)),
        randn(3, 5),
        randint(3, 5),
        CE,
    ),
    Case(
        "conv2d_same_dilation_valid_groups",
        lambda: Seq(
            nn.Conv2d(2, 4, 3, padding="same", dilation=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3, padding="valid", groups=2, bias=False),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, 3),
        ),
        randn(2, 6, 6),
        randint(3),
        CE,
    ),
    Case(
        "conv2d_circular_stride_groups",
        lambda: Seq(
            nn.Conv2d(4, 6, 3, stride=2, padding=1, padding_mode="circular", groups=2),
            nn.Tanh(),
            nn.Conv2d(6, 2, (2, 3), stride=(1, 2), padding=(1, 0), padding_mode="reflect"),
            nn.Flatten(),
            nn.Linear(2 * 3 * 1, 2),
        ),
        randn(4, 4, 8),
        binary(2),
        BCE,
    ),
    Case(
        "conv2d_few_positions_many_channels",  # 2x2 output positions, wide patches
        lambda: Seq(nn.Conv2d(6, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3)),
        randn(6, 4, 4),
        randn(3),
        MSE,
    ),
    Case(
        "conv2d_ce_trailing_axes_frozen_weight_and_bias",  # logits [N, C, H, W]
        lambda: Seq(
            frozen(nn.Conv2d(2, 3, 3, padding=1), "weight"),
            nn.Tanh(),
            frozen(nn.Conv2d(3, 3, 3, padding=1), "bias"),
        ),
        randn(2, 4, 3),
        randint(3, 4, 3),
        CE,
    ),
    Case(
        "conv2d_used_twice",
        lambda: Twice(nn.Conv2d(2, 2, 3, padding=1), Seq(nn.Flatten(), nn.Linear(2 * 4 * 4, 2))),
        randn(2, 4, 4),
        randn(2),
        MSE,
    ),
    Case(
        "conv3d_stride_padding_dilation",
        lambda: Seq(
            nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2)),
            nn.Tanh(),
            nn.Conv3d(3, 2, 1, bias=False),
            nn.Flatten(),
            nn.Linear(2 * 5 * 2 * 4, 2),
        ),
        randn(2, 4, 5, 4),
        randint(2),
        CE,
    ),
    # -- Embedding ---------------------------------------------------------------------
    Case(
        "embedding_padding_idx",
        lambda: Seq(nn.Embedding(7, 4, padding_idx=0), nn.Flatten(), nn.Linear(20, 3)),
        with_pads(7, 5),
        randint(3),
        CE,
    ),
    Case(
        "embedding_few_rows_many_tokens",  # more token pairs than table rows
        lambda: Seq(nn.Embedding(3, 4, padding_idx=2), nn.Tanh(), nn.Linear(4, 2)),
        randint(3, 8),
        randn(8, 2),
        MSE,
    ),
    Case(
        "embedding_many_rows_short_sequences",  # fewer position pairs than rows used
        lambda: Seq(nn.Embedding(40, 3, padding_idx=1), nn.Flatten(), nn.Linear(6, 2)),
        with_pads(40, 2, pad=1),
        randint(2),
        CE,
    ),
    # -- Normalization -----------------------------------------------------------------
    Case(
        "layernorm_affine_on_sequence",
        lambda: Seq(nn.Linear(3, 6), nn.LayerNorm(6), nn.Linear(6, 2)),
        randn(4, 3),
        randn(4, 2),
        MSE,
    ),
    Case(
        "layernorm_without_bias_or_affine",
        lambda: Seq(
            nn.Linear(3, 6),
            nn.LayerNorm(6, bias=False),
            nn.Tanh(),
            nn.LayerNorm(6, elementwise_affine=False),
            nn.Linear(6, 2),
        ),
        randn(3),
        randint(2),
        CE,
    ),
    Case(
        "layernorm_two_normalized_axes",
        lambda: Seq(nn.Conv1d(2, 3, 3), nn.LayerNorm((3, 4)), nn.Flatten(), nn.Linear(12, 2)),
        randn(2, 6),
        binary(2),
        BCE,
    ),
    Case(
        "groupnorm_after_conv",
        lambda: Seq(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.GroupNorm(2, 4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 3),
        ),
        randn(2, 3, 3),
        randint(3),
        CE,
    ),
    Case(
        "rmsnorm_with_and_without_affine",
        lambda: Seq(
            nn.Linear(3, 5),
            nn.RMSNorm(5),
            nn.Tanh(),
            nn.RMSNorm(5, elementwise_affine=False, eps=1e-3),
            nn.Linear(5, 2),
        ),
        randn(2, 3),
        randn(2, 2),
        MSE,
    ),
    Case(
        "batchnorm_eval",
        lambda: Seq(
            nn.Conv2d(2, 3, 3),
            eval_batchnorm(nn.BatchNorm2d(3)),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(12, 4),
            eval_batchnorm(nn.BatchNorm1d(4)),
            nn.Linear(4, 2),
        ),
        randn(2, 4, 4),
        randint(2),
        CE,
    ),
    # -- Attention ---------------------------------------------------------------------
    Case(
        "mha_batch_first_key_padding_mask_weights_used",
        lambda: Attention(batch_first=True, use_weights=True),
        attention_inputs(),
        randn(4, 3),
        MSE,
    ),
    Case(
        "mha_seq_first_kdim_vdim_bias_kv",  # q/k/v_proj_weight, bias_k, bias_v
        lambda: Attention(batch_first=False, need_weights=False, kdim=3, vdim=4, add_bias_kv=True),
        attention_inputs(kdim=3),
        randn(4, 3),
        MSE,
    ),
    Case(
        "mha_batch_first_kdim_vdim_no_bias_causal_ce",
        lambda: Attention(
            batch_first=True, kdim=5, vdim=3, bias=False, causal=True, logits_first=True
        ),
        attention_inputs(L=5, kdim=5),
        randint(3, 5),
        CE,
    ),
    Case(
        "mha_seq_first_weights_used_per_head",
        lambda: Attention(batch_first=False, use_weights=True, average_attn_weights=False),
        attention_inputs(),
        randn(4, 3),
        MSE,
    ),
    Case(
        "mha_frozen_in_proj",
        lambda: frozen(Attention(batch_first=True), "att.in_proj_weight", "att.in_proj_bias"),
        attention_inputs(),
        randn(4, 3),
        MSE,
    ),
    Case(
        "mha_partly_frozen_separate_projections",
        lambda: frozen(
            Attention(batch_first=False, kdim=3, use_weights=True),
            "att.k_proj_weight",
            "att.in_proj_bias",
            "att.out_proj.weight",
        ),
        attention_inputs(kdim=3),
        binary(4, 3),
        BCE,
    ),
    Case(
        "mha_used_twice_bias_kv_zero_attn",
        AttentionTwice,
        attention_inputs(),
        randn(4, 3),
        MSE,
    ),
    Case(
        "tiny_transformer_ce_trailing_axes",
        TinyTransformer,
        with_pads(11, 5),
        randint(11, 5),
        CE,
    ),
    # -- Layers without a rule: the torch.func fallback ----------------------------------
    Case(
        "fallback_custom_parameter",
        lambda: Seq(GatedLinear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        randn(2, 4),
        randn(2, 3),
        MSE,
    ),
    Case(
        "fallback_conv_transpose2d",
        lambda: Seq(
            nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(3 * 5 * 5, 3),
        ),
        randn(2, 3, 3),
        randint(3),
        CE,
    ),
    Case(
        "fallback_prelu",
        lambda: Seq(nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 2), nn.PReLU()),
        randn(3),
        binary(2),
        BCE,
    ),
    Case(
        "fallback_bilinear_two_inputs",
        TwoInputs,
        lambda N: (torch.randn(N, 3), torch.randn(N, 4)),
        randn(2),
        MSE,
    ),
]


# -- loss factories by reduction ----------------------------------------------------------------
def ce(reduction: str) -> nn.Module:
    return nn.CrossEntropyLoss(reduction=reduction)


def mse(reduction: str) -> nn.Module:
    return nn.MSELoss(reduction=reduction)


def bce(reduction: str) -> nn.Module:
    return nn.BCEWithLogitsLoss(reduction=reduction)


@contextmanager
def torch_state(dtype: Optional[torch.dtype] = None, seed: Optional[int] = 0) -> Iterator[None]:
    """One intra-op thread, a forked RNG seeded with ``seed`` (or none), ``dtype`` default.

    Tiny matrices run faster on one thread (far faster on a loaded machine); everything is
    restored on exit.
    """
    old_dtype, old_threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_num_threads(1)
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        torch.set_default_dtype(old_dtype)
        torch.set_num_threads(old_threads)


def force_patch_gemms(monkeypatch, one_sample: bool = False) -> List[int]:
    """Make convolutions' per-sample weight gradients take the patch GEMMs on the CPU
    (``curvature.layers.conv.PATCH_GEMM_DEVICES``), one sample per chunk of patches where
    ``one_sample``; returns a list that grows by one per call of the patch path."""
    import curvature.layers.conv as conv

    monkeypatch.setattr(conv, "PATCH_GEMM_DEVICES", ("cpu",))
    if one_sample:
        monkeypatch.setattr(conv, "PATCH_CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(conv, "PATCH_CHUNK_SHARE", 0.0)
    calls: List[int] = []
    inner = conv.patch_weight_grads
    monkeypatch.setattr(conv, "patch_weight_grads", lambda *a: calls.append(1) or inner(*a))
    return calls
