"""Benchmarks of the shipped commands (modules and device scripts here, results in bench/results/) and studies
(extension/, quality_frontier/: each with its README and results/).

Run from the repository root as modules, e.g. `python -m bench.gpu_e2e --help`, or through the shell scripts here
(on the device). Results keep their markdown and small JSON, indexed in each results folder's README.md; logs and
raw dumps stay out of git.
"""
