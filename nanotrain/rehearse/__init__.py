"""``submit.py CONFIG --rehearse``: ranks of the real job rehearsed on CPU before a GPU is used.

``stand_in`` (the meta device and the fake NCCL world), ``tracker`` (placement, host syncs,
memory, at the dispatcher), ``traffic`` (each collective's contract and bytes), ``rank`` (one
rank's build, steps, evaluation, save, load and step), ``report`` (which ranks, the defects,
what is printed).
"""
