# ResNet-14 (width 16) on Fashion-MNIST at 1 image per batch: BatchNorm (batch statistics in training, running
# statistics in eval), plain convs, in every norm slot through the norm switch (docs/any_model.md). Results:
# ./README.md
_base_ = ['./_base_/fashion-mnist_1xb1.py']
normdense_norm = dict(norm='bn', num_groups=8)
