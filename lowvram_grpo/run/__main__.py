"""`python -m lowvram_grpo.run`."""
import sys

from lowvram_grpo.run.cli import cli

sys.exit(cli())
