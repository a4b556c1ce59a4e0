"""InfiniteBench (Zhang et al., 2024): 12 long-context tasks from the official jsonl files, four of which
(passkey, number_string, kv_retrieval, math_find) can also be generated offline."""
