"""A tiny model and dataset for Runner-level tests (imported by configs via custom_imports)."""
import torch
import torch.nn as nn
from torch.utils.data import Dataset
from mmengine.model import BaseModel
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.ws import WSConv2d


@MODELS.register_module(force=True)
class NormdenseToyModel(BaseModel):
    """WS conv -> estimate-mode BCN -> pooled linear classifier; records r seen at each forward."""

    def __init__(self, channels=8, num_classes=3):
        super().__init__()
        self.conv = WSConv2d(3, channels, 3, padding=1)
        self.norm = BatchChannelNorm2d(channels, num_groups=2)
        self.head = nn.Linear(channels, num_classes)
        self.seen_rates = []

    def forward(self, inputs, labels, mode='tensor'):
        inputs = torch.stack(inputs) if isinstance(inputs, (list, tuple)) else inputs
        labels = torch.stack(labels) if isinstance(labels, (list, tuple)) else labels
        if self.training:
            self.seen_rates.append(self.norm.current_rate)
        logits = self.head(self.norm(self.conv(inputs)).relu().mean((2, 3)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, labels))
        return [dict(pred=p, label=l) for p, l in zip(logits.argmax(1), labels)]


@DATASETS.register_module(force=True)
class NormdenseToyDataset(Dataset):
    def __init__(self, length=16, size=8):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(length, 3, size, size, generator=g)
        self.labels = torch.randint(0, 3, (length,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return dict(inputs=self.images[i], labels=self.labels[i])


@METRICS.register_module(force=True)
class NormdenseToyAccuracy(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.extend(float(s['pred'] == s['label']) for s in data_samples)

    def compute_metrics(self, results):
        return dict(accuracy=sum(results) / max(len(results), 1))


@HOOKS.register_module(force=True)
class DumpBCNEstimatesHook(Hook):
    """Saves every BCN's estimates on every rank after training (for the distributed test)."""

    def after_train(self, runner):
        from mmengine.dist import get_rank
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        estimates = {name: (m.running_mean.clone(), m.running_var.clone()) for name, m in model.named_modules()
                     if isinstance(m, BatchChannelNorm2d)}
        torch.save(estimates, f'{runner.work_dir}/bcn_estimates_rank{get_rank()}.pth')
