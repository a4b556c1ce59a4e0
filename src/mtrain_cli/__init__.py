"""mtrain: long-context extension of causal LMs with distributed dynamic sparse ring attention."""

__version__ = "0.1.0"
