#!/usr/bin/env python3
"""Every crash point of every scenario (tierio.bench.crash): a table on stderr, JSON on stdout.

    scripts/crash-points.py [--scenario NAME ...] [--limit N] [--jobs 2] [--dir DIR]

The same as `tierio bench crash --json`; exits 1 when any point fails (its trial is kept on disk).
"""

import sys

from tierio.bench.crash import main

if __name__ == "__main__":  # the fork server's children import this module again: run only here
    sys.exit(main())
