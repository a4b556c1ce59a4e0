"""`mtrain eval`: RULER, Needle-in-a-Haystack, PG-19 perplexity and InfiniteBench, fully offline.

Entry point: `mtrain_cli.eval.command.run_eval_command`. Synthetic tasks are generated here; the others
read local files, and a task whose data is missing is reported as skipped, never replaced.
"""
