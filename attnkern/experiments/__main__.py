import sys

from attnkern.experiments.cli import main

sys.exit(main())
