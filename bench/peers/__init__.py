"""zero_fx against its peers (DDP, FSDP2, DeepSpeed ZeRO, plain torch.compile): the same
model, batches and steps for each, one run (``python -m bench.peers``).

cli.py parses the run and drives it, launch.py starts each peer in fresh processes, run.py
trains one peer on one rank, trainers.py holds each peer's step as its documentation writes
it, models.py the models and batches, report.py the summary and the table."""
