"""RULER (Hsieh et al., 2024): 13 synthetic long-context tasks, each prompt fitted to a target length."""
