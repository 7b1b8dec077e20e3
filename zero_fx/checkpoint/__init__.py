"""Sharded checkpoints: what is saved and loaded at any world size and stage
(``save_load``), and the folder protocol that makes a save atomic (``files``)."""
