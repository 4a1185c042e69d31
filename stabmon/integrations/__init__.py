"""Framework adapters: :mod:`stabmon.integrations.hf` (``transformers.Trainer``, extra ``hf``) and
:mod:`stabmon.integrations.lightning` (Lightning, extra ``lightning``); mirrors of stabmon's signals and events
into other tools: :mod:`stabmon.integrations.mirror` (``MirrorSink``), :mod:`stabmon.integrations.tensorboard`
(extra ``tensorboard``) and :mod:`stabmon.integrations.wandb` (extra ``wandb``); live export to the fleet's
dashboards over OTLP: :mod:`stabmon.integrations.otel` (extra ``otel``), which the monitor builds itself when asked
(``otlp=`` or the standard ``OTEL_EXPORTER_OTLP_*ENDPOINT``) and which imports the SDK only then. Nothing else here
is imported by the core; import the submodule you need."""
