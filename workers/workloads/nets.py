"""The networks seed 001 trains on Fashion-MNIST, written out here so nothing needs torchvision.

Both take ``[N, 1, 28, 28]`` images and return ``[N, 10]`` logits.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

NETS = ("lenet", "resnet18")


class LeNet(nn.Module):
    """Seed 001's LeNet: two 3x3/5x5 convolutions with ReLU and average pooling, then 800-128-10."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2)  # 28 -> 26 -> 13
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)  # 13 -> 9 -> 4
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class Residual(nn.Module):
    """d2l's residual block: two 3x3 conv+BN, with a 1x1 conv on the shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, use_1x1conv: bool = False,
                 stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, out_channels, 1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def _stage(in_channels: int, out_channels: int, residuals: int, first: bool) -> nn.Sequential:
    blocks = []
    for i in range(residuals):
        if i == 0 and not first:
            blocks.append(Residual(in_channels, out_channels, use_1x1conv=True, stride=2))
        else:
            blocks.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blocks)


def resnet18(classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """Seed 001's slightly modified ResNet-18: a 3x3 stem without max-pooling, for 28x28 inputs."""
    net = nn.Sequential(nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU())
    net.add_module("resnet_block1", _stage(64, 64, 2, first=True))
    net.add_module("resnet_block2", _stage(64, 128, 2, first=False))
    net.add_module("resnet_block3", _stage(128, 256, 2, first=False))
    net.add_module("resnet_block4", _stage(256, 512, 2, first=False))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, classes)))
    return net


def build(name: str) -> nn.Module:
    """A freshly initialised network called ``name`` (one of NETS)."""
    if name == "lenet":
        return LeNet()
    if name == "resnet18":
        return resnet18()
    raise ValueError(f"unknown network {name!r}; known: {', '.join(NETS)}")
