import sys

from dcpsim.cli import main

# Guarded: multiprocessing's forkserver may import the main module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
