"""Source files that `draftsmith.targets.kimi_mini.write_tokenizer_files` writes into a Kimi-style checkpoint folder.

Nothing imports these modules from here: transformers loads them from the checkpoint folder
through `auto_map` with `trust_remote_code`, as it does the real Kimi-K2.5's.
"""
