import sys

from dcpsim.cli import main

sys.exit(main())
