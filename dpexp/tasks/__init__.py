"""Tasks: one module per data set, each a :class:`dpexp.tasks.base.Task` (data, per-example loss, metric)
chosen by ``conf/task/*.yaml``. Imports: :mod:`dpexp.models.base` (the task-model contract), metrics."""
