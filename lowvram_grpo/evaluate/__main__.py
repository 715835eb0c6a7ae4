"""`python -m lowvram_grpo.evaluate`."""
from lowvram_grpo.evaluate.cli import main

raise SystemExit(main())
