"""Model factories: one module per family, each a :class:`dpexp.models.base.ModelFactory` (``conf/model``),
and the task-model contract (:mod:`dpexp.models.base`). Imports: torch, transformers, timm, peft; no tasks."""
