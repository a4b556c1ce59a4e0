"""Every `mtrain` user flow through the real CLI in one device call (`python -m bench.gpu_e2e`, or
bench/gpu_e2e.sh on the device; `--help` lists the flows).

Modules, each importing only those listed before it:
  scales.py       the sizes: GPU, and CPU (the same flows at tiny sizes)
  report.py       the results as markdown; merging parts run in separate calls
  job.py          records, the state passed between flows, subprocesses, the time budget, the results on disk
  environment.py  machine, versions and imports
  data.py         the recipe and the local training and eval files every flow reads
  checks.py       what a run wrote, read and checked
  flows/          the flows, a module per group; flows/__init__.py orders them and says how to add one
  runner.py       each chosen flow in order, within the budget
  __main__.py     the command line
"""
