import sys

from fq.cli import main

sys.exit(main())
