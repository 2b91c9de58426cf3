"""Tasks: one module per data set, each a :class:`dpexp.tasks.base.Task` chosen by ``conf/task/*.yaml``."""
