"""ResNet v1.5 (stride on the 3x3 conv), the architecture of torchvision's resnet18/50."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_ch, ch * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (self.downsample(x) if self.downsample else x))

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.conv3 = nn.Conv2d(ch, ch * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(ch * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_ch, ch * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.downsample(x) if self.downsample else x))

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


class ResNet(nn.Module):
    """Stem, four stages, global pool, linear head."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        zero_init_residual: bool = True,
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_ch = [], 64
        for i, blocks in enumerate(layers):
            ch, stride = 64 * 2**i, 1 if i == 0 else 2
            stage = []
            for b in range(blocks):
                stage.append(block(in_ch, ch, stride if b == 0 else 1))
                in_ch = ch * block.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(drop_rate)  # timm's drop_rate: before the classifier
        self.fc = nn.Linear(in_ch, num_classes)
        self._init(zero_init_residual)

    def _init(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            # Each residual branch starts as identity: +0.2-0.3% top-1 on ImageNet (Goyal et al.).
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.drop(torch.flatten(self.avgpool(x), 1)))


def resnet18(num_classes: int = 1000, zero_init_residual: bool = True, drop_rate: float = 0.0) -> ResNet:
    """ResNet-18: 11,689,512 parameters with 1000 classes."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, zero_init_residual, drop_rate)


def resnet50(num_classes: int = 1000, zero_init_residual: bool = True, drop_rate: float = 0.0) -> ResNet:
    """ResNet-50: 25,557,032 parameters with 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, zero_init_residual, drop_rate)
