"""Training prompt corpus: one module per source (templates, local text, Magpie), then filters and dedup.

build.py assembles them into datasets/train/prompts.jsonl.gz; every record is
{"id", "source", "category", "turns": [user messages]}.
"""
