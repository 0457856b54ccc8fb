"""The bottom layer: small shared pieces every other package may use, importing nothing of the project.

Each concept has one module here (ports, import paths, processes, distributed backends), so a second
copy elsewhere is a bug. The rule "sao_megatron.core imports nothing else of the project" is an
import-linter contract in pyproject.toml, checked by tests/unit/core/test_import_contracts.py.
Nothing here imports torch at module level: the recipe layer must load on a machine without it.
"""
