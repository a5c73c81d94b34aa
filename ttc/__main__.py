import sys

from ttc.cli import main

sys.exit(main())
