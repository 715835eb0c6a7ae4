import sys

from .run import cli

sys.exit(cli())
