"""A convolution's Kronecker statistics by either route of its patches.

On a CPU the ``"expand"`` statistics of a one-group convolution unfold the patches
kernel-major from a channels-last copy of the input (``KERNEL_MAJOR_DEVICES``), and the
``"reduce"`` statistics sum the windows in place from ``WINDOW_SUM_POSITIONS`` output
positions on; the other routes copy the patches channel-major. Both routes must give the
same factors (float64: to rounding), for every padding, stride, dilation, dimension and
bias; the reduced factors must be tensors of their own (zeroed in place by the step's
flush, no ``where`` copy).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import curvature
import curvature.layers.conv as conv

pytestmark = [
    pytest.mark.usefixtures("float64_seeded"),
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),  # torch's
]


@pytest.fixture(autouse=True)
def _small_layers_too(monkeypatch):
    """The tests' layers are small: the kernel-major route without its size floor."""
    monkeypatch.setattr(conv, "KERNEL_MAJOR_MIN_ELEMENTS", 0)


CONVS = {
    "3x3 no bias": (lambda: nn.Conv2d(3, 5, 3, padding=1, bias=False), (6, 3, 7, 7)),
    "stride, dilation, asymmetric": (
        lambda: nn.Conv2d(3, 5, (3, 2), padding=(1, 2), stride=(2, 1), dilation=(1, 2)),
        (6, 3, 8, 7),
    ),
    "reflect padding": (
        lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"),
        (6, 3, 7, 7),
    ),
    "circular, same": (
        lambda: nn.Conv2d(2, 3, 3, padding="same", padding_mode="circular"),
        (5, 2, 6, 6),
    ),
    "same, even kernel": (lambda: nn.Conv2d(3, 4, 4, padding="same"), (5, 3, 6, 6)),
    "replicate, dilation": (
        lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate", dilation=2),
        (5, 3, 6, 6),
    ),
    "conv1d": (lambda: nn.Conv1d(4, 5, 3, padding=1), (6, 4, 9)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, padding=1), (4, 2, 4, 4, 3)),
    "one input channel": (lambda: nn.Conv2d(1, 4, 3), (6, 1, 7, 7)),
    "1x1": (lambda: nn.Conv2d(4, 4, 1), (6, 4, 5, 5)),
    "groups": (lambda: nn.Conv2d(4, 4, 3, groups=2), (6, 4, 5, 5)),
}


def _factors(name: str, approx: str, fast: bool, monkeypatch, calls: int = 1, layout=None):
    make, shape = CONVS[name]
    monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ("cpu",) if fast else ())
    monkeypatch.setattr(conv, "WINDOW_SUM_POSITIONS", 1 if fast else 10**9)
    torch.manual_seed(0)
    layer = make()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):  # ``calls`` calls of one module: shared positions
            return torch.cat([self.layer(x * (i + 1)).flatten(1) for i in range(calls)], 1)

    model = Net()
    X = torch.randn(shape)
    if layout == "channels_last":
        X = X.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":  # every other channel of a wider input: no stride 1 at all
        X = torch.randn(shape[0], 2 * shape[1], *shape[2:]).mT.contiguous().mT[:, ::2]
    y = torch.randn(model(X).shape)
    res = curvature.kfac(model, nn.MSELoss(), (X, y), fisher="empirical", kfac_approx=approx)
    return {k: [t.clone() for t in v] for k, v in res.factors.items()}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", list(CONVS))
def test_both_routes_give_the_same_factors(name, approx, monkeypatch):
    slow = _factors(name, approx, False, monkeypatch)
    fast = _factors(name, approx, True, monkeypatch)
    assert slow.keys() == fast.keys() == {"layer"}
    for a, b in zip(slow["layer"], fast["layer"]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_both_routes_agree_over_several_calls_of_one_layer(approx, monkeypatch):
    slow = _factors("stride, dilation, asymmetric", approx, False, monkeypatch, calls=2)
    fast = _factors("stride, dilation, asymmetric", approx, True, monkeypatch, calls=2)
    for a, b in zip(slow["layer"], fast["layer"]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["channels_last", "sliced"])
def test_both_routes_agree_on_inputs_of_any_layout(layout, monkeypatch):
    slow = _factors("3x3 no bias", "expand", False, monkeypatch, layout=layout)
    fast = _factors("3x3 no bias", "expand", True, monkeypatch, layout=layout)
    for a, b in zip(slow["layer"], fast["layer"]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_the_kernel_major_route_is_exact_for_one_sample(monkeypatch):
    """One datum, MSE, one conv: KFAC-expand's ``kron(G, A)`` is not exact (weight
    sharing), but ``A`` is ``1 / S sum_s a_s a_s^T`` of the patches, built here by hand."""
    monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ("cpu",))
    layer = nn.Conv2d(2, 3, 3, padding=1, stride=2)
    X = torch.randn(1, 2, 6, 5)
    y = torch.randn(1, 3 * 3 * 3)
    model = nn.Sequential(layer, nn.Flatten())
    res = curvature.kfac(model, nn.MSELoss(), (X, y), fisher="empirical")
    A = res.factors["0"][0]
    patches = nn.functional.unfold(X, 3, padding=1, stride=2)[0].T  # [S, C k k]
    a = torch.cat([patches, torch.ones(len(patches), 1)], 1)
    torch.testing.assert_close(A, a.T @ a / len(a), rtol=1e-12, atol=1e-12)


def test_the_route_follows_the_rows_per_patch_entry(monkeypatch):
    """Kernel-major where ``N S >= KERNEL_MAJOR_ROWS * D`` and ``N S D >=
    KERNEL_MAJOR_MIN_ELEMENTS`` on the CPU, one group only."""
    taken = []
    inner = conv.kernel_major_sums
    monkeypatch.setattr(conv, "kernel_major_sums", lambda *a: taken.append(1) or inner(*a))

    def step(layer, shape):
        taken.clear()
        model = nn.Sequential(layer, nn.Flatten())
        opt = curvature.KFAC(model, lr=1e-3)
        model(torch.randn(shape)).square().mean().backward()
        opt.step()
        return bool(taken)

    assert step(nn.Conv2d(4, 4, 3, padding=1), (8, 4, 5, 5))  # N S = 200 >= 18
    assert not step(nn.Conv2d(64, 4, 3, padding=1), (2, 64, 1, 1))  # N S = 2 < 288
    assert not step(nn.Conv2d(4, 4, 3, padding=1, groups=2), (8, 4, 5, 5))
    monkeypatch.setattr(conv, "KERNEL_MAJOR_MIN_ELEMENTS", 200 * 36 + 1)  # N S D = 7200
    assert not step(nn.Conv2d(4, 4, 3, padding=1), (8, 4, 5, 5))
    monkeypatch.setattr(conv, "KERNEL_MAJOR_MIN_ELEMENTS", 200 * 36)
    assert step(nn.Conv2d(4, 4, 3, padding=1), (8, 4, 5, 5))
    monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ())
    assert not step(nn.Conv2d(4, 4, 3, padding=1), (8, 4, 5, 5))


class Selects(TorchDispatchMode):
    """The sizes of the ``where`` calls made inside the mode (their largest operand)."""

    def __init__(self):
        super().__init__()
        self.sizes: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("where"):
            self.sizes.append(max(a.numel() for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layer", ["conv", "linear"])
def test_reduced_factors_are_zeroed_in_place_not_selected(layer, monkeypatch):
    """The ``"reduce"`` statistics (like ``"expand"``'s) are tensors of their own: the
    step's flush zeroes them in place, without a ``where`` (which copies a factor)."""
    torch.manual_seed(0)
    if layer == "conv":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 16, 2))
        X = torch.randn(8, 3, 6, 6)
    else:  # a Linear layer over shared positions [N, S, D]
        model = nn.Sequential(nn.Linear(5, 4), nn.Flatten(), nn.Linear(4 * 3, 2))
        X = torch.randn(8, 3, 5)
    opt = curvature.KFAC(model, lr=1e-3, kfac_approx="reduce")
    for _ in range(2):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(X), torch.zeros(8, dtype=torch.long)).backward()
        with Selects() as selects:
            opt.step()
    # (the step's own selects are of counts and flags, at most one per output channel)
    assert selects.sizes and max(selects.sizes) <= 4, selects.sizes


def test_the_benchmark_script_runs_and_reports_both_routes(capsys):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import conv_patches

    conv_patches.main(["--device", "cpu", "--batch", "2", "--reps", "1", "--layers", "resnet"])
    out = capsys.readouterr().out
    assert out.count("kernel-major") >= 7 and "rel. diff" in out
    assert conv.WINDOW_SUM_POSITIONS == 2  # restored


def _corrections(name: str, fast: bool, monkeypatch, fisher: str = "empirical"):
    make, shape = CONVS[name]
    monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ("cpu",) if fast else ())
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Flatten())
    X = torch.randn(shape)
    y = torch.randn(model(X).shape)
    approx = curvature.ekfac(model, nn.MSELoss(), (X, y), fisher=fisher)
    return {b.name: b.corrections.clone() for b in approx.blocks}


@pytest.mark.parametrize("name", [n for n in CONVS if n != "groups"])
def test_ekfac_corrections_agree_by_either_route(name, monkeypatch):
    """EKFAC's corrections from kernel-major patches (the basis's rows taken in their
    order) equal those from the channel-major ones."""
    slow = _corrections(name, False, monkeypatch)
    made = []
    inner = conv.kernel_major_patches
    monkeypatch.setattr(conv, "kernel_major_patches", lambda *a: made.append(1) or inner(*a))
    fast = _corrections(name, True, monkeypatch)
    assert len(made) == 2  # the factors' pass made one, the corrections' pass another
    assert slow.keys() == fast.keys() == {"0"}
    torch.testing.assert_close(fast["0"], slow["0"], rtol=1e-12, atol=1e-12)


def test_ekfac_corrections_of_several_vectors_agree_by_either_route(monkeypatch):
    slow = _corrections("stride, dilation, asymmetric", False, monkeypatch, "type-2")
    fast = _corrections("stride, dilation, asymmetric", True, monkeypatch, "type-2")
    torch.testing.assert_close(fast["0"], slow["0"], rtol=1e-12, atol=1e-12)


def test_the_kernel_major_order_maps_onto_the_weights_columns():
    layer = nn.Conv2d(2, 3, (2, 3), bias=True)
    x = torch.randn(4, 2, 5, 6)
    a_c = conv.unfold_patches(layer, x)[:, :, 0]  # [N, S, C k], channel-major
    a_k = conv.kernel_major_patches(layer, x, True)  # [N, S, k C + 1]
    order = conv.kernel_major_order(layer, True)
    torch.testing.assert_close(a_k[..., :-1], a_c[..., order[:-1]], rtol=0, atol=0)
    assert order[-1] == 12 and bool((a_k[..., -1] == 1).all())


def test_a_strided_1x1_convolution_keeps_the_channel_major_patches(monkeypatch):
    """Its padded input is ``prod(stride)`` times its patches: the channels-last copy
    would take more memory than the patches (the chunk bound counts the patches)."""
    taken = []
    inner = conv.kernel_major_sums
    monkeypatch.setattr(conv, "kernel_major_sums", lambda *a: taken.append(1) or inner(*a))
    model = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.Flatten())
    opt = curvature.KFAC(model, lr=1e-3)
    model(torch.randn(16, 4, 8, 8)).square().mean().backward()
    opt.step()
    assert not taken


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_an_unbatched_call_is_refused_by_either_route(approx, monkeypatch):
    """A convolution called per sample on ``[C, H, W]`` inputs whose ``C`` equals the
    batch size (so the sample axis looks right upstream): the layer's clear error."""
    for fast in (False, True):
        monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ("cpu",) if fast else ())
        monkeypatch.setattr(conv, "WINDOW_SUM_POSITIONS", 1 if fast else 10**9)

        class PerSample(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(5, 4, 3, padding=1)
                self.head = nn.Linear(4 * 36, 3)

            def forward(self, x):
                return self.head(torch.stack([self.conv(xi).flatten() for xi in x]))

        X, y = torch.randn(5, 5, 6, 6), torch.randint(0, 3, (5,))
        with pytest.raises(ValueError, match="unbatched input"):
            curvature.kfac(PerSample(), nn.CrossEntropyLoss(), (X, y), kfac_approx=approx)
