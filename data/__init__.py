"""Data the project makes or ships: the demo corpus, tokenizer and tiny-base model, and the scripts that build
corpora (`python -m data.make_corpus`, `python -m data.make_code_corpus`, from the repository root)."""
