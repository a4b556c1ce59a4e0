"""Sparse training's quality frontier (`python -m bench.quality_frontier`; README.md says how to run it).

Modules, each importing only those listed before it:
  study.py     the models, sparse variants and floors
  schedule.py  the device calls that run them (bench/extension jobs)
  device.py    one call on the device, and what it returned filed here (`take`)
  frontier.py  the sparse jobs' reports as rows per model, the floors they meet, the dense check against the eval
  report.py    the frontier as JSON, markdown and a figure
  __main__.py  the command line: plan, call, take, report
"""
