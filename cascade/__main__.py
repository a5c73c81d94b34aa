import sys

from cascade.cli import main

sys.exit(main())
