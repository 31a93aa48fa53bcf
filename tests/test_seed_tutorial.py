"""The seed tutorial (../shared/seed, ResNet-34 on CIFAR-100) runs on rptrain with only its imports changed.

TUTORIAL is the tutorial's code, transcribed section by section; the only edits are the two
import lines (roundpipe -> rptrain). `shrink` then makes it fit a CPU test and each change is
asserted to hit exactly once: EPOCHS 20 -> 2 and DataLoader workers 2 -> 0. The network stays
the tutorial's ResNet-34 in fp16; the data is a tiny CIFAR-100 in the real on-disk format that
the real torchvision CIFAR100 class reads (download=True finds it and downloads nothing).
fp16 convolutions are slow on a CPU (about 0.5 s per image for forward + backward), hence 8
training images.
"""
from __future__ import annotations

import math
import re

import matplotlib
import pytest
from cifar_fixture import fake_cifar

TUTORIAL = '''
import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
import matplotlib.pyplot as plt
from tqdm import tqdm
from rptrain import RoundPipe, OptimizerCtx, GradScaler
from rptrain.optim import Adam

# ResNet Basic Block
class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out

def make_blocks(in_channels, out_channels, blocks, stride):
    layers = []
    layers.append(BasicBlock(in_channels, out_channels, stride))
    for _ in range(1, blocks):
        layers.append(BasicBlock(out_channels, out_channels))
    return layers

def build_resnet(num_classes=100):
    layers = [
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        *make_blocks(32, 64, 3, 2),
        *make_blocks(64, 128, 4, 2),
        *make_blocks(128, 256, 6, 2),
        *make_blocks(256, 512, 3, 2),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    ]
    return nn.Sequential(*layers)

transform_train = transforms.Compose([
    transforms.RandomHorizontalFlip(),
    transforms.RandomCrop(32, 4),
    transforms.ToTensor(),
    transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
])
transform_test = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
])
trainset = datasets.CIFAR100(root="./data", train=True, download=True, transform=transform_train)
testset = datasets.CIFAR100(root="./data", train=False, download=True, transform=transform_test)
trainloader = DataLoader(trainset, batch_size=128, shuffle=True, num_workers=2)
testloader = DataLoader(testset, batch_size=128, shuffle=False, num_workers=2)

model = RoundPipe(build_resnet().to(torch.float16), optim_dtype=torch.float32)
with OptimizerCtx():
    optimizer = Adam(model.parameters())
scaler = GradScaler()
criterion = nn.CrossEntropyLoss()

def evaluate(loader):
    model.eval()
    correct, total, loss_sum = 0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(torch.float16), labels
            outputs = model(images)
            loss = criterion(outputs.float(), labels)
            loss_sum += loss.item() * labels.size(0)
            _, predicted = outputs.max(1)
            correct += predicted.eq(labels).sum().item()
            total += labels.size(0)
    return loss_sum / total, correct / total

train_losses, test_losses = [], []
train_accs, test_accs = [], []

def optimizer_step():
    scaler.step(optimizer)
    optimizer.zero_grad()

EPOCHS = 20
for epoch in range(EPOCHS):
    model.train()
    running_loss, correct, total = 0, 0, 0
    for images, labels in tqdm(trainloader, desc=f"Epoch {epoch+1}/{EPOCHS}", leave=False):
        loss, outputs = model.forward_backward(
            input_args=(images.to(torch.float16),),
            label=labels,
            loss_fn=lambda outputs, labels: scaler.scale(
                criterion(outputs.float(), labels)
            ) / (torch.cuda.device_count() + 1),
            return_outputs=True,
        )
        model.step(optimizer_step)
        scaler.update()
        loss_item = loss.item() / scaler.get_scale()
        running_loss += loss_item * labels.size(0)
        _, predicted = outputs.max(1)
        correct += predicted.eq(labels).sum().item()
        total += labels.size(0)
    train_loss = running_loss / total
    train_acc = correct / total
    test_loss, test_acc = evaluate(testloader)
    train_losses.append(train_loss)
    test_losses.append(test_loss)
    train_accs.append(train_acc)
    test_accs.append(test_acc)
    print(
        f"Epoch {epoch+1:02d}/{EPOCHS} | "
        f"Train Loss: {train_loss:.4f} | Train Acc: {train_acc:.4f} | "
        f"Test Loss: {test_loss:.4f} | Test Acc: {test_acc:.4f}"
    )

fig, axes = plt.subplots(1, 2, figsize=(12, 5))
axes[0].plot(train_losses, label="Train Loss")
axes[0].plot(test_losses, label="Test Loss")
axes[0].set_xlabel("Epoch"); axes[0].set_ylabel("Loss")
axes[0].legend(); axes[0].set_title("Loss Curve")
axes[1].plot(train_accs, label="Train Acc")
axes[1].plot(test_accs, label="Test Acc")
axes[1].set_xlabel("Epoch")
axes[1].set_ylabel("Accuracy")
axes[1].legend()
axes[1].set_title("Accuracy Curve")
plt.tight_layout()
plt.show()
'''

# The tutorial's own output line, e.g. "Epoch 01/20 | Train Loss: 4.3328 | Train Acc: 0.0413 | Test Loss: 3.9271 | Test Acc: 0.0791".
EPOCH_LINE = re.compile(
    r"^Epoch (\d\d)/(\d+) \| Train Loss: (\d+\.\d{4}) \| Train Acc: (\d\.\d{4}) \| "
    r"Test Loss: (\d+\.\d{4}) \| Test Acc: (\d\.\d{4})$"
)


def shrink(code: str, epochs: int) -> str:
    """The only edits besides the imports: fewer epochs, no worker processes."""
    edits = [("EPOCHS = 20\n", f"EPOCHS = {epochs}\n"), ("num_workers=2)", "num_workers=0)")]
    for old, new in edits:
        assert code.count(old) >= 1, f"the tutorial no longer contains {old!r}"
        code = code.replace(old, new)
    return code


def test_tutorial_line_format_matches_its_published_output():
    line = "Epoch 01/20 | Train Loss: 4.3328 | Train Acc: 0.0413 | Test Loss: 3.9271 | Test Acc: 0.0791"
    assert EPOCH_LINE.match(line)


@pytest.mark.slow
def test_seed_tutorial_runs_unchanged_on_rptrain(tmp_path, monkeypatch, capsys):
    fake_cifar(tmp_path / "data", monkeypatch, "cifar100", n_train=8, n_test=8)
    monkeypatch.chdir(tmp_path)  # the tutorial reads ./data
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    namespace: dict = {"__name__": "tutorial"}
    exec(compile(shrink(TUTORIAL, epochs=2), "seed_tutorial", "exec"), namespace)
    try:
        out = capsys.readouterr().out
        lines = [m for m in map(EPOCH_LINE.match, out.splitlines()) if m]
        assert [(m[1], m[2]) for m in lines] == [("01", "2"), ("02", "2")], out
        for m in lines:
            train_loss, train_acc, test_loss, test_acc = (float(m[i]) for i in (3, 4, 5, 6))
            # 100 classes: an untrained net sits near ln(100) = 4.6; fp16 must not have produced inf/nan.
            assert math.isfinite(train_loss) and 0.5 < train_loss < 15, m[0]
            assert math.isfinite(test_loss) and 0.5 < test_loss < 50, m[0]
            assert 0.0 <= train_acc <= 1.0 and 0.0 <= test_acc <= 1.0
        assert namespace["scaler"].get_scale() > 1.0  # the scaler backed off at most a few times
        assert len(namespace["train_losses"]) == 2
    finally:
        namespace["model"].close()
        plt.close("all")


@pytest.mark.parametrize("epochs", [2])
def test_shrink_changes_only_epochs_and_workers(epochs):
    small = shrink(TUTORIAL, epochs)
    changed = [(a, b) for a, b in zip(TUTORIAL.splitlines(), small.splitlines()) if a != b]
    assert len(changed) == 3  # EPOCHS and the two DataLoaders
    assert TUTORIAL.count("from rptrain") == 2 and "roundpipe" not in TUTORIAL
