"""CIFAR-style ResNets (3x3 stem, no max-pool) flattened into one nn.Sequential.

Every residual block is a single Sequential element, so the pipeline engine can
cut between any two blocks. `resnet34` reproduces a tutorial network parameter
for parameter (module order and names included), so keep the layout as is.
"""

from contextlib import nullcontext

import torch
from torch import nn

from rptrain.models.registry import register_model

Device = torch.device | str | None


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """1x1 conv + BN when the block changes resolution or width; None (identity) otherwise."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride, as in torchvision) -> 1x1 expand."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _stage(block: type[nn.Module], in_channels: int, width: int, n: int, stride: int) -> list[nn.Module]:
    """First block changes resolution/width, the remaining n-1 keep it."""
    out_channels = width * block.expansion
    return [block(in_channels, width, stride)] + [block(out_channels, width) for _ in range(n - 1)]


def resnet(
    block: type[nn.Module],
    depths: tuple[int, ...],
    num_classes: int = 100,
    stem_channels: int = 32,
    widths: tuple[int, ...] = (64, 128, 256, 512),
    device: Device = None,
    dtype: torch.dtype | None = None,
) -> nn.Sequential:
    if len(depths) != len(widths):
        raise ValueError(f"depths {depths} and widths {widths} must have the same length")
    # Building under a device context lets huge variants go straight to "meta".
    with torch.device(device) if device is not None else nullcontext():
        layers: list[nn.Module] = [
            nn.Conv2d(3, stem_channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(stem_channels),
            nn.ReLU(),
        ]
        channels = stem_channels
        for width, depth in zip(widths, depths):
            layers += _stage(block, channels, width, depth, stride=2)
            channels = width * block.expansion
        layers += [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(channels, num_classes)]
        model = nn.Sequential(*layers)
    return model.to(dtype) if dtype is not None else model


@register_model("resnet18")
def resnet18(num_classes: int = 100, stem_channels: int = 32, widths: tuple[int, ...] = (64, 128, 256, 512),
             device: Device = None, dtype: torch.dtype | None = None) -> nn.Sequential:
    return resnet(BasicBlock, (2, 2, 2, 2), num_classes, stem_channels, widths, device, dtype)


@register_model("resnet34")
def resnet34(num_classes: int = 100, stem_channels: int = 32, widths: tuple[int, ...] = (64, 128, 256, 512),
             device: Device = None, dtype: torch.dtype | None = None) -> nn.Sequential:
    return resnet(BasicBlock, (3, 4, 6, 3), num_classes, stem_channels, widths, device, dtype)


@register_model("resnet50")
def resnet50(num_classes: int = 100, stem_channels: int = 32, widths: tuple[int, ...] = (64, 128, 256, 512),
             device: Device = None, dtype: torch.dtype | None = None) -> nn.Sequential:
    return resnet(Bottleneck, (3, 4, 6, 3), num_classes, stem_channels, widths, device, dtype)
