import sys

from hipress.cli import main

sys.exit(main())
