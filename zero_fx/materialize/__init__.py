"""Models too big for one device: values for a model built on the meta device, this rank's only.

Takes the model (``with torch.device("meta"): model = Model(cfg)``) and the shard
plan when the step shards it, and hands ``ShardedState`` this rank's shards:

- ``events.py``: the initialization the model's construction ran, as events to replay
  ([Note: replaying construction]); ``hf.py`` the HuggingFace part of it;
- ``replay.py``: runs them one module at a time, with the random generator where a
  normal build had it ([Note: building one module at a time]); ``writes.py`` sees
  what each event writes;
- ``safetensors_files.py``, ``pretrained.py``: HuggingFace weights read straight into
  shards (``load_pretrained``);
- ``materialize.py``: puts either into the model, keeping what this rank holds;
  ``model_tensors.py`` lists the model's tensors once each, with every place each is
  registered (tied weights).
"""

from .materialize import materialize
from .pretrained import LoadedWeights, PretrainedWeights, load_pretrained
from .replay import MaterializeError

__all__ = ["LoadedWeights", "load_pretrained", "materialize", "MaterializeError", "PretrainedWeights"]
