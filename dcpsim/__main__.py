import sys

from dcpsim.cli import main, signals

# Guarded: multiprocessing's forkserver may import the main module as __mp_main__.
if __name__ == "__main__":
    code = main()
    if signals.fired():
        signals.leave(code)
    sys.exit(code)
