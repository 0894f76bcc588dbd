"""`python -m jaxptd.pipeline.schedules`: the schedules CLI, whose code is simulate.py's
`main` (it makes, lowers and times a schedule, so it sits above all three modules)."""
import sys

from jaxptd.pipeline.simulate import main

sys.exit(main())
