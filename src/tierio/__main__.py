import sys

from tierio.cli.main import main

sys.exit(main())
