"""Test helpers, in one package (test modules import from here, never from each other).

* ``dist`` — ``run_distributed``: a function in N gloo processes, hard timeout, no orphans;
* ``slurm`` — job ids, states and waits against the real local SLURM cluster;
* ``nccl_sim`` — a P2P transport with NCCL's semantics on threads (pipeline deadlock proofs);
* ``contract`` — the device contract of every tensor handed to torch.distributed;
* ``models`` — the tiny models, batches and gradient gathering the parallel tests share;
* ``runs`` — CLI runs of the tiny config, and the reference runs shared by several test files;
* ``cli`` — ``run_cli``: submit.py's command line called in-process, its output captured;
* ``processes`` — a running job seen from outside: its step, a rank's pid, its latest checkpoint;
* ``checkpoints`` — the one-process tiny model, a training step of it, damage to a saved file;
* ``hf_reference`` — transformers' Llama in float64 (and its llama3 RoPE frequencies), the reference;
* ``compat`` — the checkpoint fixture of an older format: its parts, its run, a parameter digest.
* ``family_tokenizers`` — tokenizer.json files in the Llama 3, Mistral and Qwen2 styles, built offline.
"""
