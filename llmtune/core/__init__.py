"""The trainer core shared by every stage: trainer, stage contract, run directory, callbacks."""
