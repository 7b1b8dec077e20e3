"""Benchmarks: peers/ (zero_fx against DDP, FSDP2 and DeepSpeed), experiments/ (one question
each) and helpers/ (what they share). Each writes JSON under bench/out/."""
