"""`python -m jaxptd.hf`: runs `jaxptd.hf.bridge.main`."""
import sys

from jaxptd.hf.bridge import main

sys.exit(main())
