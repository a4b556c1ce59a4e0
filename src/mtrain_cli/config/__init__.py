"""The typed recipe tree: YAML recipes + dotted overrides -> one validated `Config`.

A recipe is YAML whose keys mirror the dataclasses of tree.py. Overrides use dotted paths (`--set train.lr=1e-5`,
values parsed as YAML); load.py builds and resolves the tree, checks.py validates it. Every bad input is a
`UserError` whose one line names the field, the value and the fix.
"""

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.config.checks import check_launch
from mtrain_cli.config.load import attention_from_dict, config_from_dict, default_recipe, load_config, read_model_config
from mtrain_cli.config.tree import (
    CheckpointConfig,
    Config,
    ContextConfig,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    to_yaml,
)

__all__ = [
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "ContextConfig",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "attention_from_dict",
    "check_launch",
    "config_from_dict",
    "default_recipe",
    "load_config",
    "read_model_config",
    "to_yaml",
]
