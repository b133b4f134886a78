"""`python -m grpo_megatron ...` (also what torchrun runs with `-m grpo_megatron`)."""

import sys

from grpo_megatron.cli import main

sys.exit(main())
