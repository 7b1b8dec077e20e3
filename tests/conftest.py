import os
import sys

# tests import the example's GPT (the model the example trains) as `examples.gpt`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
