"""The optimizers inside the training stacks people use (issue: "KFAC in the training stacks").

- Finalization: a second object sharing an optimizer's attributes (Lightning's
  ``LightningOptimizer``, a ``copy.copy``) must never remove the hooks of the live
  optimizer when it is collected; simulated without Lightning, then with it.
- BatchNorm in train mode: its parameters get the plain gradient, every conv / linear
  layer keeps its curvature; a ResNet-18 with BatchNorm trains on real data (digits).
- PyTorch Lightning's ``Trainer`` and transformers' ``Trainer`` (skipped where absent).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import pathlib
import sys
import warnings
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from cases import torch_state, train_step
from torch import nn

import curvature

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from resnets import resnet18  # noqa: E402  (benchmarks/resnets.py, shared with training.py)

CE = nn.CrossEntropyLoss()


@pytest.fixture(autouse=True)
def _one_thread_seeded():
    with torch_state():
        yield


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int = 0, N: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


@cache
def _digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).view(-1, 1, 8, 8)
    X = F.interpolate(X, size=(16, 16), mode="bilinear", align_corners=False)
    return (X - X.mean()) / X.std(), torch.tensor(y)


def digits():
    """sklearn's 8x8 digits, resized to ``[1797, 1, 16, 16]``, standardized; labels ``[1797]``."""
    pytest.importorskip("sklearn")
    return _digits()


# -- finalization: objects sharing the optimizer's attributes ------------------------------------
class SharedDict:
    """A dynamic subclass sharing the optimizer's ``__dict__`` (earlier Lightning versions)."""

    def __init__(self, optimizer):
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            "Shared" + type(optimizer).__name__, (SharedDict, type(optimizer)), {}
        )


class CopiedDict:
    """A dynamic subclass with a shallow copy of the ``__dict__`` (the same collector)."""

    def __init__(self, optimizer):
        self.__dict__ = dict(optimizer.__dict__)
        self.__class__ = type(
            "Copied" + type(optimizer).__name__, (CopiedDict, type(optimizer)), {}
        )


class Forwarding:
    """A dynamic subclass forwarding missing attributes (Lightning 2.x)."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Fwd" + type(optimizer).__name__, (Forwarding, type(optimizer)), {})

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


WRAPPERS = [SharedDict, CopiedDict, Forwarding, copy.copy]


@pytest.mark.parametrize("wrap", WRAPPERS, ids=lambda w: getattr(w, "__name__", str(w)))
@pytest.mark.parametrize(
    "cls,fisher",
    [
        (curvature.KFAC, "empirical"),
        (curvature.KFAC, "mc"),
        (curvature.EKFAC, "type-2"),
        (curvature.DiagonalNaturalGradient, "empirical"),
    ],
)
def test_collected_wrapper_leaves_the_optimizer_hooks(wrap, cls, fisher):
    model = mlp()
    opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    hooks = hook_count(model)
    assert hooks > 0
    wrapper = wrap(opt)
    assert isinstance(wrapper, cls)
    del wrapper
    gc.collect()
    assert hook_count(model) == hooks
    for seed in range(2):
        train_step(opt, model, *batch(seed))
    assert set(opt.blocks) == {"0", "2"}
    if cls is not curvature.DiagonalNaturalGradient:
        assert set(opt.factors()) == {"0", "2"}
    del opt
    gc.collect()
    assert hook_count(model) == 0  # the finalizer of the real optimizer still removes them


def test_collected_capture_copy_leaves_the_hooks():
    model = mlp()
    cap = curvature.capture(model)
    cap.attach()
    hooks = hook_count(model)
    twin = copy.copy(cap)
    del twin
    gc.collect()
    assert hook_count(model) == hooks
    del cap
    gc.collect()
    assert hook_count(model) == 0


def test_rebuilt_collector_is_the_one_the_finalizer_closes():
    """Freezing a layer rebuilds the statistics collector; the finalizer follows it."""
    model = mlp()
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2)
    train_step(opt, model, *batch())
    model[0].requires_grad_(False)
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        train_step(opt, model, *batch(1))
    assert hook_count(model) > 0
    del opt
    gc.collect()
    assert hook_count(model) == 0


# -- BatchNorm in train mode ---------------------------------------------------------------------
def bn_cnn(seed: int = 0, affine: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4, affine=affine),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 16 * 16, 10),
        nn.BatchNorm1d(10, affine=affine),
    )


OPTIMIZERS = [
    (curvature.KFAC, "empirical"),
    (curvature.KFAC, "mc"),
    (curvature.KFAC, "type-2"),
    (curvature.EKFAC, "empirical"),
    (curvature.DiagonalNaturalGradient, "empirical"),
]


def _blocks(opt):
    if isinstance(opt, curvature.DiagonalNaturalGradient):
        return set(opt.blocks)
    return set(opt.factors())


@pytest.mark.parametrize("unsupported", ["warn", "diagonal"])
@pytest.mark.parametrize("cls,fisher", OPTIMIZERS)
def test_batchnorm_in_train_mode_gets_the_plain_gradient(cls, fisher, unsupported):
    """Every BatchNorm parameter moves by exactly -lr * grad; conv and linear by their
    preconditioned gradient (not -lr * grad); the BatchNorm layers have no block."""
    if cls is curvature.DiagonalNaturalGradient and unsupported == "diagonal":
        pytest.skip("DiagonalNaturalGradient covers every layer it captures")
    X, y = digits()
    X, model = X.double(), bn_cnn().double()
    with pytest.warns(UserWarning, match=r"2 BatchNorm layer\(s\) \('1', '5'\).*plain gradient"):
        opt = cls(
            model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE, kl_clip=None,
            unsupported=unsupported,
        )  # fmt: skip
    assert opt.uncovered == ["1.bias", "1.weight", "5.bias", "5.weight"]
    for step in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        CE(model(X[:32]), y[:32]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            delta = p.detach() - before[n]
            if n.startswith(("1.", "5.")):
                torch.testing.assert_close(delta, -0.1 * grads[n], rtol=1e-10, atol=1e-14)
            elif step:  # the curvature of the first step's statistics is used
                assert not torch.allclose(delta, -0.1 * grads[n], rtol=1e-3, atol=0)
    assert _blocks(opt) == {"0", "4"}


@pytest.mark.parametrize("cls,fisher", OPTIMIZERS)
def test_frozen_and_affine_free_batchnorm_need_nothing(cls, fisher):
    """Without trainable BatchNorm parameters nothing is reported; the other layers
    keep their curvature (the BatchNorm layers still normalize with batch statistics)."""
    X, y = digits()
    for model in (bn_cnn(affine=False), bn_cnn()):
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.requires_grad_(False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
        for i in range(2):
            train_step(opt, model, X[32 * i : 32 * i + 32], y[32 * i : 32 * i + 32])
        assert _blocks(opt) == {"0", "4"} and opt.uncovered == []


def test_batchnorm_statistics_of_the_other_layers_are_the_batch_rows():
    """With BatchNorm in train mode the empirical factors of a linear layer are those of
    its recorded inputs and of the rows of the batch loss' output gradient (KFAC's
    convention: A = a^T a / N, G = N g^T g for a mean loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    X, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    with pytest.warns(UserWarning, match="BatchNorm"):
        opt = curvature.KFAC(model, lr=0.1, damping=1e-2, factor_decay=0.0)
    inputs, outs = {}, {}
    for name in ("0", "3"):
        layer = model.get_submodule(name)
        layer.register_forward_hook(lambda m, a, o, name=name: inputs.__setitem__(name, a[0]))
        layer.register_forward_hook(lambda m, a, o, name=name: outs.__setitem__(name, o))
    opt.zero_grad()
    out = model(X)
    for o in outs.values():
        o.retain_grad()
    CE(out, y).backward()
    opt.step()
    N = X.shape[0]
    for name in ("0", "3"):
        a = torch.cat([inputs[name], torch.ones(N, 1, dtype=torch.float64)], 1)
        g = outs[name].grad
        A, G = opt.factors()[name]
        torch.testing.assert_close(A, a.T @ a / N)
        torch.testing.assert_close(G, N * g.T @ g)


def test_per_sample_quantities_of_a_batchnorm_train_model_are_still_refused():
    model = bn_cnn()
    X, y = digits()
    with pytest.raises(ValueError, match=r"Module '1' \(BatchNorm2d\).*mixes the samples"):
        curvature.per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), X[:4], y[:4])
    for m in model.modules():  # frozen: the other layers' per-sample gradients still mix
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.requires_grad_(False)
    with pytest.raises(ValueError, match="mixes the samples"):
        curvature.capture(model)


# -- ResNet-18 with BatchNorm on digits ----------------------------------------------------------
def _resnet_run(cls, fisher, steps=12, **kw):
    """Train a width-8 ResNet-18 on digits; the held-out loss before and after (in train
    mode: batch statistics), and the cosine between the second update of the stem
    convolution and its negative gradient (1 for SGD)."""
    X, y = digits()
    torch.manual_seed(0)
    model = resnet18(num_classes=10, in_channels=1, width=8)
    if cls is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        with pytest.warns(UserWarning, match="20 BatchNorm layer"):
            opt = cls(model, lr=0.05, damping=1e-2, fisher=fisher, loss_func=CE, **kw)
    Xe, ye = X[-256:], y[-256:]
    with torch.no_grad():
        before = float(CE(model(Xe), ye))
    cosine = None
    for i in range(steps):
        p0 = model.conv1.weight.detach().clone()
        train_step(opt, model, X[32 * i : 32 * i + 32], y[32 * i : 32 * i + 32])
        if i == 1:  # the first step that uses curvature
            delta = (model.conv1.weight.detach() - p0).flatten()
            cosine = float(F.cosine_similarity(delta, -model.conv1.weight.grad.flatten(), 0))
    with torch.no_grad():
        after = float(CE(model(Xe), ye))
    return model, opt, before, after, cosine


@pytest.mark.parametrize("cls,fisher", [*OPTIMIZERS[:2], *OPTIMIZERS[3:]])
def test_resnet18_with_batchnorm_trains_on_digits(cls, fisher):
    model, opt, before, after, cosine = _resnet_run(cls, fisher, kl_clip=1e-2)
    convs = {n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert len(convs) == 21  # 20 convolutions (3 shortcuts) and the classifier
    assert _blocks(opt) == convs
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bn) == 20 and sorted(f"{n}.{p}" for n in bn for p in ("bias", "weight")) == (
        opt.uncovered
    )
    assert after < before - 0.5, (before, after)
    assert cosine < 0.99, cosine  # preconditioned: not the direction of SGD's update


def test_resnet18_full_width_constructs_and_takes_a_step():
    """``KFAC(resnet18(num_classes=10))`` out of the box (torchvision's where it imports);
    one step on two 32x32 images: factors for every conv and linear layer whose
    factors fit max_factor_size, the 512-channel 3x3 convs get their diagonal."""
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = curvature.KFAC(model)  # the defaults
    assert any("20 BatchNorm layer" in str(w.message) for w in caught)
    opt.zero_grad()
    CE(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    opt.step()
    assert len(opt.blocks) == 21 and len(opt.factors()) == 18  # 3 convs: 4608 > 4096
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_loop_that_calls_a_submodule_is_told_for_pulled_fishers():
    """Built on a wrapper whose submodule the loop calls (a LightningModule's self.net):
    the empirical Fisher records the layers; mc gets one warning naming the way out."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

    for fisher in ("empirical", "mc"):
        model = Wrapper()
        opt = curvature.KFAC(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(3):
                train_step(opt, model.net, *batch(seed))
        messages = [str(w.message) for w in caught]
        if fisher == "empirical":
            assert messages == [] and set(opt.factors()) == {"net.0", "net.2"}
        else:
            assert sum("was never called" in m for m in messages) == 1, messages
            assert "KFAC(self.net)" in messages[0]


# -- PyTorch Lightning ---------------------------------------------------------------------------
def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


NO_LIGHTNING = "needs lightning (pip install lightning, or -e '.[test]')"


@pytest.mark.skipif(_missing("lightning"), reason=NO_LIGHTNING)
def test_lightning_optimizer_wrapper_keeps_the_hooks():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = mlp()
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2)
    hooks = hook_count(model)
    wrapper = LightningOptimizer(opt)
    assert isinstance(wrapper, curvature.KFAC)
    del wrapper
    gc.collect()
    assert hook_count(model) == hooks
    train_step(opt, model, *batch())
    assert set(opt.factors()) == {"0", "2"}


def _lightning_fit(fisher: str):
    import lightning as L

    X, y = digits()
    X = X[:, :, ::2, ::2].reshape(len(X), -1)[:320]  # [320, 64]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, y[:320]), batch_size=32, shuffle=False
    )

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
            self.loss_func = nn.CrossEntropyLoss()
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_func(self(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            self.optim = curvature.KFAC(
                self, lr=0.1, damping=1e-2, fisher=fisher, loss_func=self.loss_func
            )
            return self.optim

    module = Classifier()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    gc.collect()
    return module


@pytest.mark.skipif(_missing("lightning"), reason=NO_LIGHTNING)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_lightning_trainer_collects_curvature(fisher):
    module = _lightning_fit(fisher)
    opt = module.optim
    assert set(opt.factors()) == {"net.0", "net.2"}
    assert opt.steps == 20 and hook_count(module) > 0
    for A, G in opt.factors().values():
        assert torch.isfinite(A).all() and torch.isfinite(G).all() and G.abs().sum() > 0
    first, last = sum(module.losses[:5]) / 5, sum(module.losses[-5:]) / 5
    assert last < first - 0.5, module.losses


# -- transformers ------------------------------------------------------------------------------
NO_TRANSFORMERS = "needs transformers and accelerate (pip install transformers accelerate)"
HF_ABSENT = _missing("transformers") or _missing("accelerate")


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _token_task(n: int = 128, length: int = 8):
    """Label 1 iff token 3 occurs in the sequence."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    pos = torch.randint(0, length, (n,), generator=g)
    ids[labels == 1, pos[labels == 1]] = 3
    return ids, labels


@pytest.mark.skipif(HF_ABSENT, reason=NO_TRANSFORMERS)
def test_dict_output_model_with_mc_in_a_plain_loop():
    """A model returning a ModelOutput: fisher='mc' pulls from the input of the user's
    own loss_func call on out["logits"] (the same as out.logits)."""
    model = _tiny_bert()
    ids, labels = _token_task()
    opt = curvature.KFAC(model, lr=0.5, damping=1e-2, fisher="mc", loss_func=CE, kl_clip=1e-2)
    losses = []
    for _epoch in range(3):
        for i in range(8):
            opt.zero_grad()
            out = model(input_ids=ids[16 * i : 16 * i + 16])
            loss = CE(out["logits"], labels[16 * i : 16 * i + 16])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    factors = opt.factors()
    assert {"classifier", "bert.encoder.layer.0.output.dense"} <= set(factors)
    assert factors["classifier"][1].abs().sum() > 0
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.04, losses


@pytest.mark.skipif(HF_ABSENT, reason=NO_TRANSFORMERS)
def test_model_computed_loss_with_a_registered_output():
    """The model computes its own loss (labels given); register_output(out.logits, ...)
    names what fisher='mc' samples from: the same factors as calling loss_func."""
    ids, labels = _token_task()
    factors = []
    for register in (True, False):
        model = _tiny_bert()
        opt = curvature.KFAC(model, lr=0.1, damping=1e-2, fisher="mc", loss_func=CE, seed=3)
        for i in range(2):
            opt.zero_grad()
            X, t = ids[16 * i : 16 * i + 16], labels[16 * i : 16 * i + 16]
            if register:
                out = model(input_ids=X, labels=t)
                opt.register_output(out.logits, CE, t)
                loss = out.loss
            else:
                loss = CE(model(input_ids=X).logits, t)
            loss.backward()
            opt.step()
        factors.append(opt.factors())
    assert set(factors[0]) == set(factors[1]) and "classifier" in factors[0]
    for name in factors[0]:
        torch.testing.assert_close(factors[0][name], factors[1][name], rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(HF_ABSENT, reason=NO_TRANSFORMERS)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_transformers_trainer_collects_curvature(fisher, tmp_path):
    from transformers import Trainer

    model = _tiny_bert()
    ids, labels = _token_task()
    data = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    loss_func = nn.CrossEntropyLoss()
    opt = curvature.KFAC(
        model, lr=0.5, damping=1e-2, fisher=fisher, loss_func=loss_func, kl_clip=1e-2
    )

    class CurvatureTrainer(Trainer):
        """The documented recipe for fisher='mc': call loss_func on the logits."""

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = loss_func(outputs.logits, labels)
            return (loss, outputs) if return_outputs else loss

    trainer_cls = CurvatureTrainer if fisher == "mc" else Trainer
    trainer = trainer_cls(
        model=model, args=_hf_args(tmp_path), train_dataset=data, optimizers=(opt, None)
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert opt.steps == 24 and len(losses) == 24
    factors = opt.factors()
    assert {"classifier", "bert.pooler.dense", "bert.encoder.layer.0.output.dense"} <= set(factors)
    assert all(G.abs().sum() > 0 for _, G in (factors["classifier"],))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.04, losses


@pytest.mark.skipif(HF_ABSENT, reason=NO_TRANSFORMERS)
def test_transformers_trainer_mc_without_a_loss_func_call_is_refused(tmp_path):
    """The model computes its loss inside forward (labels given) and returns a ModelOutput:
    nothing tells fisher='mc' what to sample from, so a clear error names the recipe."""
    from transformers import Trainer

    model = _tiny_bert()
    ids, labels = _token_task(32)
    data = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2, fisher="mc", loss_func=CE)
    trainer = Trainer(
        model=model, args=_hf_args(tmp_path), train_dataset=data, optimizers=(opt, None)
    )
    with pytest.raises(ValueError, match=r"loss_func\(out\.logits, y\)"):
        trainer.train()


def _hf_args(tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_train_epochs=3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )


@pytest.mark.parametrize("name", ["ggn", "empirical_fisher", "fisher"])
def test_dense_references_refuse_batchnorm_in_train_mode_clearly(name):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with pytest.raises(ValueError, match="'1' \\(BatchNorm1d\\) normalizes with batch statistics"):
        getattr(curvature, name)(model, nn.CrossEntropyLoss(), (X, y))
    model.eval()  # running statistics: a per-sample function again
    assert getattr(curvature, name)(model, nn.CrossEntropyLoss(), (X, y)).shape == (34, 34)
