"""Per-sample weight gradients of convolutions as batched GEMMs over unfolded patches.

On a GPU (``curvature.layers.conv.PATCH_GEMM_DEVICES``) the per-sample weight gradients
of a convolution are ``g_nc @ P_nc`` per sample and group, a chunk of samples' patches
at a time, instead of one convolution backward with ``N * groups`` groups (which cuDNN
runs as about one kernel per group). Here that path is taken on the CPU and checked
against ``torch.func`` (``vmap`` of ``grad`` of each sample's loss) through the public
functions: ``per_sample_grads``, per-sample gradient norms from a capture, and the
empirical Fisher diagonal, for Conv1d/2d/3d with groups, stride, dilation, padding
modes and no bias, the whole batch in one chunk and one sample per chunk.
"""

from __future__ import annotations

import pytest
import torch
from cases import force_patch_gemms
from torch import nn
from torch.func import functional_call, grad, vmap

import curvature
import curvature.layers.conv as conv

pytestmark = pytest.mark.usefixtures("float64_seeded")
N = 6


@pytest.fixture(params=["whole", "one-sample"])
def patches(request, monkeypatch):
    return force_patch_gemms(monkeypatch, one_sample=request.param == "one-sample")


CONVS = {
    "1d-groups-stride": lambda: nn.Conv1d(4, 6, 3, stride=2, groups=2),
    "2d-dilation-padding": lambda: nn.Conv2d(4, 4, 3, padding=2, dilation=2),
    "2d-same-reflect-no-bias": lambda: nn.Conv2d(
        4, 2, 2, padding="same", padding_mode="reflect", bias=False
    ),
    "3d-groups": lambda: nn.Conv3d(4, 4, 2, groups=4),
}
SPATIAL = {"1d": (9,), "2d": (6, 5), "3d": (4, 4, 3)}


def model_and_data(kind):
    torch.manual_seed(0)
    c = CONVS[kind]()
    X = torch.randn(N, 4, *SPATIAL[kind[:2]])
    model = nn.Sequential(c, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    model(X)
    return model, X, torch.randint(0, 3, (N,))


def twin(model, X, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, t):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), t[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)


@pytest.mark.parametrize("kind", CONVS)
def test_per_sample_quantities_equal_the_twin(kind, patches):
    model, X, y = model_and_data(kind)
    expected = twin(model, X, y)
    CE = nn.CrossEntropyLoss()
    got = curvature.per_sample_grads(model, CE, X, y)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12, msg=k)
    with curvature.capture(model) as cap:
        out = model(X)
    norms = cap.per_sample_grad_norms(nn.CrossEntropyLoss(reduction="none")(out, y))
    twin_norms = torch.stack([v.flatten(1).pow(2).sum(1) for v in expected.values()]).sum(0)
    torch.testing.assert_close(norms.pow(2), twin_norms, rtol=1e-10, atol=1e-12)
    diag = curvature.diag_ggn(model, nn.CrossEntropyLoss(reduction="sum"), (X, y), "empirical")
    for k, v in expected.items():
        torch.testing.assert_close(diag[k], v.pow(2).sum(0), rtol=1e-10, atol=1e-12, msg=k)
    assert patches  # the patch path ran


def test_a_differentiable_result_through_chunks(monkeypatch):
    # autograd through the chunks (no preallocated buffer) gives the grouped path's gradients
    torch.manual_seed(0)
    m = nn.Conv2d(4, 6, 3, padding=1, groups=2).double()
    x = torch.randn(5, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 6, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, *m.weight.shape, dtype=torch.float64)
    res = {}
    monkeypatch.setattr(conv, "PATCH_GEMM_POSITIONS", 0)
    for path in ("grouped", "patches"):
        if path == "patches":
            monkeypatch.setattr(conv, "PATCH_GEMM_DEVICES", ("cpu",))
            monkeypatch.setattr(conv, "PATCH_CHUNK_ELEMENTS", 1)
            monkeypatch.setattr(conv, "PATCH_CHUNK_SHARE", 0.0)
        value = conv.per_sample_weight_grads(m, x, g)
        res[path] = (value, *torch.autograd.grad((value * w).sum(), (x, g)))
    for a, b in zip(res["grouped"], res["patches"]):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "size, channels, patches",
    [(4, 32, True), (8, 32, False), (2, 8, True), (3, 8, False)],
    ids=["16 positions, 32 channels", "64 positions, 32 channels", "4, 8", "9, 8"],
)
def test_a_cpu_takes_the_patch_gemms_for_few_positions_per_channel(size, channels, patches):
    # on a CPU: patch GEMMs where output positions <= PATCH_GEMM_POSITIONS (0.5) x the input
    # channels of a group, else one grouped convolution backward; the same values either way
    torch.manual_seed(0)
    m = nn.Conv2d(channels, 3, 3, padding=1)
    x = torch.randn(4, channels, size, size)
    g = torch.randn(4, 3, size, size)
    calls = []
    inner = conv.patch_weight_grads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv, "patch_weight_grads", lambda *a: calls.append(1) or inner(*a))
        got = conv.per_sample_weight_grads(m, x, g)
    assert bool(calls) == patches
    expected = torch.stack([twin_one(m, x[i], g[i]) for i in range(4)])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def twin_one(m, x, g):
    """One sample's weight gradient by autograd."""
    return torch.autograd.grad((m(x[None]) * g[None]).sum(), m.weight)[0]


def test_the_benchmark_compares_both_paths_on_cpu(capsys):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import conv_weight_grads

    conv_weight_grads.main(["--device", "cpu", "--layers", "resnet", "--batch", "2", "--reps", "1"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ResNet conv" in ln]
    assert len(lines) == len(conv_weight_grads.LAYERS["resnet"])
    assert all("grouped conv" in ln and "patch GEMMs" in ln and "rel. diff" in ln for ln in lines)
    assert conv.PATCH_GEMM_POSITIONS == 0.5 and conv.PATCH_GEMM_DEVICES == ("cuda",)  # restored
