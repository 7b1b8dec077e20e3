"""``python -m zero_fx.plan``: the planner's command line (zero_fx/planner/cli.py)."""

from ..planner.cli import main

if __name__ == "__main__":
    main()
