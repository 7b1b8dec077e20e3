"""Sharded checkpoints: what a checkpoint holds (``contents``), saved and loaded at any world
size and stage (``save_load``); the live run's whole state dict (``state_dict``); a checkpoint
read in one process, without a run (``offline``); and the folder protocol that makes a save
atomic (``files``)."""
