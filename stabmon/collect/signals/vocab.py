"""The loss of an untrained model, from the model's output classes: what tells a run from scratch from a
fine-tune of a trained model.

A randomly initialised classifier over ``V`` classes predicts near-uniformly, so its first cross-entropy is
close to ``ln V`` (the tiny GPT of ``examples/tiny_gpt.py``: 2.7 against ln 13 = 2.56; GPT-2 124M from scratch:
about 11 against ln 50257 = 10.8). A pre-trained language model starts a fine-tune far below it (1-3 nats
against 10-12). The monitor records ``untrained_loss = ln V`` once, with its first step, when it can tell
``V``; the ``no_progress`` detector reads it (:mod:`stabmon.detect.progress`).

``V`` is the model's ``config.vocab_size`` (Hugging Face models), else the output size of its last
``nn.Linear`` when an ``nn.Embedding`` of the model has as many rows (a language model's head over its
vocabulary, tied or not); else unknown (a classifier head, a regression model).

>>> import torch.nn as nn
>>> class LM(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.wte, self.head = nn.Embedding(13, 8), nn.Linear(8, 13)
>>> round(untrained_loss(LM()), 4)
2.5649
>>> untrained_loss(nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 2))) is None   # a classifier: unknown
True
"""

from __future__ import annotations

import math

from torch import nn


def output_classes(model: nn.Module) -> int | None:
    """The number of classes the model's loss is a cross-entropy over, when it can be told (see the module)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 1:
        return size
    rows = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    last = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last = module
    if last is not None and last.out_features > 1 and last.out_features in rows:
        return int(last.out_features)
    return None


def untrained_loss(model: nn.Module) -> float | None:
    """``ln V`` for a model over ``V`` output classes, or None when ``V`` cannot be told."""
    classes = output_classes(model)
    return math.log(classes) if classes is not None else None
