"""`python -m jaxptd.train`: runs `jaxptd.train.loop.main`."""
import sys

from jaxptd.train.loop import main

sys.exit(main())
