"""Framework adapters: :mod:`stabmon.integrations.hf` (``transformers.Trainer``, extra ``hf``) and
:mod:`stabmon.integrations.lightning` (Lightning, extra ``lightning``). Nothing here is imported by the core;
import the submodule you need."""
