"""Studies of one question each (stages side by side, the schedule, regional compilation,
quantized communication, offload on a GPU, a long soak, ...): each module runs with
``python -m bench.experiments.NAME`` (or torchrun ``-m``) and writes JSON under bench/out/."""
