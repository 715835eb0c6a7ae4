import sys

from lowvram_grpo.run.cli import cli

sys.exit(cli())
