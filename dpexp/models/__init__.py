"""Model factories: one module per family, each a :class:`dpexp.tasks.base.ModelFactory` (``conf/model``)."""
