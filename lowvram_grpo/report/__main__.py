"""`python -m lowvram_grpo.report`."""
from lowvram_grpo.report.build import main

raise SystemExit(main())
