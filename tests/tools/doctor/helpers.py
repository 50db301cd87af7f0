"""A config, a subject and a scripted step (its loss a given sequence of values, which puts a
check exactly on its boundary) for the doctor's tests one check at a time."""

from __future__ import annotations

import torch
from torch import nn

from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.engine.step_fns import classification_step
from ironloop.tools.doctor.subject import DoctorSubject
from tests.conftest import blobs, tiny_mlp


def config(**over) -> Config:
    base = {"train.batch_size": 4, "optim.lr": 1e-2, "run.dir": "unused", "run.device": "cpu",
            "data.shuffle": False}
    return Config().with_overrides({**base, **{k.replace("__", "."): v for k, v in over.items()}})


class Scripted:
    """A step whose loss is the next value of a script (the last one again past its end): a
    check's thresholds can be met exactly. It runs the model, so hooks see its outputs, and
    its loss reaches the parameters, so backward and the optimizer step run."""

    def __init__(self, *values: float):
        self.values, self.calls = list(values), 0

    def __call__(self, model, batch):
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        out = model(batch[0])
        return out.float().sum() * 0 + torch.tensor(v, dtype=torch.float64), {}


def make(model=None, train=None, step=None, num_classes=3, user_step=False, val=None,
         **over) -> DoctorSubject:
    cfg = config(**over)
    return DoctorSubject(model=model if model is not None else tiny_mlp(),
                         cfg=cfg, train=train if train is not None else blobs(32),
                         val=val, num_classes=num_classes, device=torch.device("cpu"),
                         step_fn=step or classification_step(nn.CrossEntropyLoss()),
                         user_step=user_step)


def batch_of(n=4, d=8, c=3):
    data = blobs(n, d, c)
    return data.x, data.y


# -- data checks: labels --------------------------------------------------------------------------

def labelled(labels, val=None, c=3, **kw) -> DoctorSubject:
    y = torch.tensor(labels)
    v = None if val is None else TensorData(torch.zeros(len(val), 2), torch.tensor(val))
    return make(train=TensorData(torch.zeros(len(y), 8), y), val=v, num_classes=c, **kw)
