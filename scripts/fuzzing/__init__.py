"""The parts of scripts/fuzz_config.py: the config mutations (config_mutations), the harness that
runs one answer under the contract (harness), the hostile files and the tiny checkpoint the cases
point at (workspace), the generated categories (scripts, paths, yaml11, unicode: cases, values),
the fixed corpus (corpus.yaml, corpus) and the loop that runs and judges cases (runner)."""
