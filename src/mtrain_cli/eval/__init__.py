"""`mtrain eval`: RULER, Needle-in-a-Haystack, PG-19 perplexity and InfiniteBench, fully offline.

The command end to end: command.py. What a suite is: suite.py; the suites, one line each, and the command line
checked against them: registry.py; the command's options: options.py (each suite's own inputs sit in its
module). Synthetic tasks are generated here; the others read local files, and a task whose data is missing
is reported as skipped, never replaced.

This is the package's public face; other packages import from here (RULER's tasks: eval.ruler). Names resolve on
first use: importing the face loads nothing heavy.
"""

from mtrain_cli.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "command": ("FAR_BEYOND_CONTEXT", "EvalInterrupted", "run_eval", "run_eval_command"),
        "registry": ("OPTIONS", "SUITES", "parse_options"),
        "options": ("check_attention",),
        "loading": ("load_model",),
        "sparse": ("attention_routing", "sparse_request"),
        "runner": ("Runner",),
        "prompts": ("PromptFormat",),
        "haystack": ("NOISE_HAYSTACK", "essay_haystack"),
        "pg19": ("SECOND_HALF",),
        "results": ("length_label",),
        "plots": ("niah_heatmap",),
    },
)
