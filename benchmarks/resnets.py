"""ResNet-18 for the tests and benchmarks/training.py: torchvision's when it imports, else
a faithful copy.

The copy follows ``torchvision.models.resnet.resnet18``: a 7x7 stride-2 stem with
BatchNorm, ReLU and a 3x3 max-pool, four stages of two ``BasicBlock`` each (3x3 convs
with BatchNorm, a 1x1 conv + BatchNorm shortcut where the shape changes), adaptive
average pooling and a linear classifier. ``width`` scales the channels (64 in
torchvision) so that a test can train it in seconds on a CPU; ``in_channels`` allows
grey-scale inputs.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn


def torchvision_resnet18(num_classes: int) -> Optional[nn.Module]:
    """``torchvision.models.resnet18(num_classes=...)``, or ``None`` if it does not import."""
    try:
        from torchvision.models import resnet18
    except Exception:  # absent, or built for another torch (an import error of its own)
        return None
    return resnet18(num_classes=num_classes)


class BasicBlock(nn.Module):
    """Two 3x3 convs with BatchNorm; the identity or a 1x1 conv + BatchNorm as shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016) with torchvision's layer names and initialization."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        inplanes = width
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> nn.Module:
    """torchvision's ResNet-18 where it imports (3 channels, width 64), else :class:`ResNet18`."""
    if in_channels == 3 and width == 64:
        model = torchvision_resnet18(num_classes)
        if model is not None:
            return model
    return ResNet18(num_classes, in_channels, width)
