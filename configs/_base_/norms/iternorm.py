# IterNorm (Huang et al., Algorithm 1): group-wise whitening by Newton's iteration, 64 channels per group,
# T=5, in every norm slot ("all norms" placement of the paper, Sec. 3.3), with plain convs.
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
conv_cfg = None
norm_cfg = dict(type='IterNorm', group_size=64, T=5)
