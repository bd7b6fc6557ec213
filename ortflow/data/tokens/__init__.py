"""Language-model data as a token store: sources (text files, folders, JSON lines, parquet, saved datasets) are
tokenized once (prepare.py, encode.py, tokenizer.py, sources.py) into token files and a manifest (store.py) that
training streams random blocks from (blocks.py). This package imports no torch: the encoding worker processes
import only what they need."""
