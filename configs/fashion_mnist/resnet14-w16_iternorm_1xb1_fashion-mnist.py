# ResNet-14 (width 16) on Fashion-MNIST at 1 image per batch: IterNorm (group-wise whitening, 64 channels per
# group, T = 5), plain convs, in every norm slot through the norm switch (docs/any_model.md). Results:
# ./README.md
_base_ = ['./_base_/fashion-mnist_1xb1.py']
normdense_norm = dict(norm='iternorm', num_groups=8)
