"""RULER (Hsieh et al., 2024): 13 synthetic long-context tasks, each prompt fitted to a target length.

The suite: suite.py; a task and what its prompts are drawn from: task.py; the tasks, one module per kind. The face
bench/ builds RULER prompts through."""

from mtrain_cli.eval.ruler.suite import RULER_TASKS, TASK_NAMES, build_sample
from mtrain_cli.eval.ruler.task import TaskData

__all__ = ["RULER_TASKS", "TASK_NAMES", "TaskData", "build_sample"]
