"""GPU benchmarks and experiments on the shipped commands, and their committed results (bench/results/).

Run from the repository root as modules, e.g. `python -m bench.gpu_e2e --help`, or through the shell scripts here
(on the device). Results keep their markdown and small JSON; logs and raw dumps stay out of git.
"""
