"""`python -m sao_megatron.trainer.rank_main RESOLVED_RECIPE.toml`: one rank started by a launcher."""
import sys

from sao_megatron.trainer.entry import rank_main

if __name__ == "__main__":
    sys.exit(rank_main())
