# ResNet-14 (width 16) on Fashion-MNIST at 2 images per batch: GroupNorm, 8 groups, plain convs, in every norm
# slot through the norm switch (docs/any_model.md). Results: ./README.md
_base_ = ['./_base_/fashion-mnist_1xb2.py']
normdense_norm = dict(norm='gn', num_groups=8)
