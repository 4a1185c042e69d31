"""Framework adapters: :mod:`stabmon.integrations.hf` (``transformers.Trainer``, extra ``hf``) and
:mod:`stabmon.integrations.lightning` (Lightning, extra ``lightning``); mirrors of stabmon's signals and events
into other tools: :mod:`stabmon.integrations.mirror` (``MirrorSink``), :mod:`stabmon.integrations.tensorboard`
(extra ``tensorboard``) and :mod:`stabmon.integrations.wandb` (extra ``wandb``). Nothing here is imported by the
core; import the submodule you need."""
