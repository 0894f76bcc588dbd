"""`python -m jaxptd.plan`: runs the planner's command line (jaxptd/plan/cli.py)."""
import sys

from jaxptd.plan.cli import main

sys.exit(main())
