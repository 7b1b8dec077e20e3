"""The old path of ``zero_fx.models`` (the models moved out of the planner): importing it
gives that module itself, so every class is the same object under both names."""

import sys

from .. import models

sys.modules[__name__] = models
