"""`python -m filtx.demo`: see `filtx.demo` and `filtx.demo.cli`."""

import sys

from filtx.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
