"""`mtrain env`: the versions and devices a bug report needs."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

import mtrain_cli

_PACKAGES = ("torch", "triton", "transformers", "datasets", "tokenizers", "typer", "rich", "wandb")


def environment_report() -> dict[str, str]:
    report = {"mtrain": mtrain_cli.__version__, "python": platform.python_version(), "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            report[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            report[name] = "not installed"
    report["cuda available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        report["cuda (torch build)"] = str(torch.version.cuda)
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report[f"gpu {index}"] = (
                f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
            )
    report["cpu threads (torch)"] = str(torch.get_num_threads())
    report["distributed backends"] = ", ".join(
        b
        for b, ok in (("nccl", torch.distributed.is_nccl_available()), ("gloo", torch.distributed.is_gloo_available()))
        if ok
    )
    return report
