"""Training: the builder (config -> this rank's model stage and engine), one optimizer step, the
stop vote, and the trainer loop. Above every library layer, below the launcher."""
