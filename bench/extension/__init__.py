"""The context-extension experiment (`python -m bench.extension`, or bench/extension_experiment.sh on the device).

Modules, each importing only those listed before it:
  scales.py            sizes and the time plan of each scale
  handoff.py           what passes between the device jobs of the scales of several jobs, and the checks on it
  markdown.py          the report's markdown
  plots.py             the report's figures
  training.py          the training runs' figures: step times, tokens/s, speed on one machine, plans per layer
  report.py            the report: what the runs, evals and probes wrote, as JSON, markdown, figures and logs
  job.py               one device job: its machine, records, subprocesses, deadline
  evals.py             which evaluations run, in which order, within the budget
  phases.py            corpus, pretraining, extensions, and the parts a later job takes
  jobs.py              the kinds of job (--phase) and how they chain: joining earlier jobs, checking settings
  variants.py          a sparse job of several variants against one dense run (--variant)
  __main__.py          the command line
  seeds.py             runs that differ in the training seed, side by side (`python -m bench.extension.seeds`)
  rerun.py             one extension trained again, with the same losses, joined into a finished report
  cap_sweep.py         the first layer's sparse pattern by cap and length, on CPU (`python -m ...cap_sweep`)
  sparsity_by_layer.py the sparse pattern per layer on held-out text (a subprocess of the evals)
"""
