import pytest
import torch
from torch import nn

from rptrain.models import build_model, list_models
from rptrain.models.resnet import BasicBlock, Bottleneck, resnet34

# Counted by hand from the tutorial's layer list (see _resnet34_param_count).
RESNET34_CIFAR100_PARAMS = 21_311_108


def _resnet34_param_count(num_classes: int) -> int:
    """Sum of weight shapes, written independently of rptrain.models.resnet."""

    def conv(k, cin, cout):
        return k * k * cin * cout

    def bn(c):
        return 2 * c  # weight + bias (running stats are buffers)

    total = conv(3, 3, 32) + bn(32)
    cin = 32
    for width, n in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for j in range(n):
            i = cin if j == 0 else width
            total += conv(3, i, width) + bn(width) + conv(3, width, width) + bn(width)
            if j == 0:  # every stage starts with stride 2, so it has a downsample branch
                total += conv(1, i, width) + bn(width)
        cin = width
    return total + 512 * num_classes + num_classes


def test_resnet34_parameter_count():
    model = resnet34(num_classes=100)
    n = sum(p.numel() for p in model.parameters())
    print(f"resnet34(num_classes=100): {n} parameters")
    assert n == _resnet34_param_count(100) == RESNET34_CIFAR100_PARAMS


def test_resnet34_structure_matches_tutorial():
    model = build_model("resnet34")
    assert isinstance(model, nn.Sequential)
    assert len(model) == 3 + (3 + 4 + 6 + 3) + 3
    assert [type(m) for m in model[:3]] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    assert [type(m) for m in model[-3:]] == [nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    block = model[3]
    assert isinstance(block, BasicBlock)
    assert [name for name, _ in block.named_children()] == ["conv1", "bn1", "relu", "conv2", "bn2", "downsample"]
    assert model[4].downsample is None
    # parameter names and shapes in module order
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["0.weight", "1.weight", "1.bias"]
    assert names[3:9] == ["3.conv1.weight", "3.bn1.weight", "3.bn1.bias", "3.conv2.weight", "3.bn2.weight", "3.bn2.bias"]
    assert names[9:12] == ["3.downsample.0.weight", "3.downsample.1.weight", "3.downsample.1.bias"]
    assert model[3].conv1.weight.shape == (64, 32, 3, 3) and model[3].conv1.stride == (2, 2)
    assert model[-1].weight.shape == (100, 512)


@pytest.mark.parametrize("name,features", [("resnet18", 512), ("resnet34", 512), ("resnet50", 2048)])
def test_forward_shapes(name, features):
    torch.manual_seed(0)
    model = build_model(name, num_classes=100)
    assert model[-1].in_features == features
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 100)
    out.sum().backward()


def test_resnet50_uses_bottlenecks():
    model = build_model("resnet50", num_classes=10)
    blocks = [m for m in model if isinstance(m, Bottleneck)]
    assert len(blocks) == 16
    assert blocks[0].conv3.out_channels == 256 and blocks[-1].conv3.out_channels == 2048


def test_overrides_and_meta_device():
    model = build_model("resnet18", num_classes=10, stem_channels=16, widths=(16, 32, 64, 128))
    assert model[0].out_channels == 16 and model[-1].weight.shape == (10, 128)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    meta = build_model("resnet50", device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in meta.parameters())


def test_registry():
    names = list_models()
    assert {"resnet18", "resnet34", "resnet50"} <= set(names)
    assert names == sorted(names)
    with pytest.raises(ValueError, match="resnet34"):
        build_model("resnet35")
