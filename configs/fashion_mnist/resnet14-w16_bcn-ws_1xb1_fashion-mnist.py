# ResNet-14 (width 16) on Fashion-MNIST at 1 image per batch: Batch-Channel Normalization in estimate mode
# (Algorithm 1, r = lr), 8 groups, with WS, in every norm slot through the norm switch (docs/any_model.md).
# Results: ./README.md
_base_ = ['./_base_/fashion-mnist_1xb1.py']
normdense_norm = dict(norm='bcn-ws', num_groups=8)
