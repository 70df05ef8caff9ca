"""WS conv + BCN everywhere mmdet's Mask R-CNN and mmseg's DeepLabV3 accept conv_cfg/norm_cfg."""
import pytest
import torch
from mmcv.cnn import ConvModule

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.ws import WSConv2d
from tests.mm_models import deeplabv3_cfg, det_train_step, mask_rcnn_cfg, seg_train_step

WS = dict(type='WSConv2d')
BCN = dict(type='BCN', num_groups=32, mode='estimate')


def _bcn_estimates_moved(model):
    bcns = [m for m in model.modules() if isinstance(m, BatchChannelNorm2d)]
    return bcns, all(bool((m.running_mean != 0).any()) for m in bcns)


@pytest.mark.codebases
def test_mask_rcnn_ws_bcn_training_step():
    model, losses = det_train_step(mask_rcnn_cfg(conv_cfg=WS, norm_cfg=BCN))
    assert {'loss_rpn_cls', 'loss_bbox', 'loss_mask'} <= set(losses)
    bcns, moved = _bcn_estimates_moved(model)
    # backbone (stem + 2 per basic block x 8 + 4 downsample) + FPN (4 lateral + 4 output) + 4 bbox convs + 4 mask convs
    assert len(bcns) == 1 + 16 + 3 + 8 + 4 + 4 and moved
    for part in (model.backbone, model.neck, model.roi_head.bbox_head, model.roi_head.mask_head):
        assert any(isinstance(m, WSConv2d) for m in part.modules())
    assert all(isinstance(m.conv, WSConv2d) for m in model.roi_head.bbox_head.shared_convs
               if isinstance(m, ConvModule))


@pytest.mark.codebases
def test_deeplabv3_ws_bcn_training_step_batch_one():
    # batch size 1: ASPP's image-pool branch normalizes a 1x1 map, which estimate-mode BCN handles
    model, losses = seg_train_step(deeplabv3_cfg(conv_cfg=WS, norm_cfg=BCN), batch_size=1)
    assert 'decode.loss_ce' in losses and 'aux.loss_ce' in losses
    bcns, moved = _bcn_estimates_moved(model)
    assert moved and any(isinstance(m.norm, BatchChannelNorm2d) for m in model.decode_head.image_pool.modules()
                         if isinstance(m, ConvModule))


@pytest.mark.codebases
def test_mask_rcnn_ws_bcn_fused_equals_reference_training_step():
    """The fused BCN path (default) through the whole detector (backbone, FPN, shared bbox convs, mask head;
    RoI heads see a varying number of RoIs) against the reference composition (fused=False): one SGD step
    gives the same losses, estimates and weights."""
    fused, losses = det_train_step(mask_rcnn_cfg(conv_cfg=WS, norm_cfg=BCN))
    ref, ref_losses = det_train_step(mask_rcnn_cfg(conv_cfg=WS, norm_cfg=dict(BCN, fused=False)))
    bcns, moved = _bcn_estimates_moved(fused)
    assert moved and all(m.fused for m in bcns)
    assert not any(m.fused for m in _bcn_estimates_moved(ref)[0])
    assert losses.keys() == ref_losses.keys()
    for k in losses:
        assert losses[k] == pytest.approx(ref_losses[k], rel=1e-4, abs=1e-6), k
    state = ref.state_dict()
    other_state = fused.state_dict()
    assert state.keys() == other_state.keys()
    for k, v in state.items():
        torch.testing.assert_close(other_state[k], v, rtol=1e-4, atol=1e-4, msg=k)
