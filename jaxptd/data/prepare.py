"""`python -m jaxptd.data.prepare`: text files -> a prepared token directory (or a
Megatron-LM indexed dataset). The command is jaxptd/data/corpus.py's `main`; this module
is only its entry, which nothing imports (jaxptd/data/__init__.py imports corpus.py).
"""
import sys

from jaxptd.data.corpus import main

if __name__ == "__main__":
    sys.exit(main())
