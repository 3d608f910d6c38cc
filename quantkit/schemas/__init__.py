"""User files (recipes, plans, measurements) read with line numbers and validated against pydantic models.

:mod:`quantkit.schemas.located` loads YAML and JSON into plain dicts and lists that remember the line of every
key and item; :mod:`quantkit.schemas.validate` validates such a tree against a model and turns the first
problem into one ``QuantkitError`` that names ``file:line``, the key path, what was expected and what was found.
"""
