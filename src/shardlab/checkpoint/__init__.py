"""Checkpoints: writing and resuming them, resharding across strategies, exporting to Hugging Face format.

    store.py     atomic save (step-N.tmp -> step-N), the latest complete checkpoint, resume
    reshard.py   elastic resume: a checkpoint of one strategy / world size read by another
    export.py    `shardlab export CKPT OUT`: any checkpoint as a Hugging Face model + tokenizer, offline

The package itself imports nothing.
"""
